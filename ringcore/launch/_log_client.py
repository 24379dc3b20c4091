"""Log forwarding, the worker's side: prefixed lines to the driver's log server, and
rank 0's progress (:func:`report_progress`) over the same connection.

A worker opens one :class:`LogConnection` to its launcher's
:class:`~ringcore.launch.LogServer` (:func:`connect_log`: None when it cannot reach it,
and the output then stays local), puts :func:`stream_pair`'s two streams in place of
``sys.stdout`` / ``sys.stderr`` (every line prefixed ``[rank]<stdout>:``), says
:meth:`LogConnection.done` when its function returned (elastic jobs) and closes the
connection last, so the driver's drain sees every line before the end line.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from .._auth import answer
from .._config import RANK_ENV_VAR
from ._log_server import (
    DONE_TAG,
    HANDSHAKE_TIMEOUT_S,
    PROGRESS_TAG,
    STDERR_TAG,
    STDOUT_TAG,
    read_line,
)

__all__ = ["LogConnection", "PrefixedLines", "connect_log", "report_progress", "stream_pair"]

TIMESTAMP_FORMAT = "%a %b %d %H:%M:%S %Y"  # Horovod's


class LogConnection:
    """One authenticated connection to the driver's log server; ``send`` is thread-safe.

    ``stage_id``: the worker's group, answered with its number (:attr:`stage_attempt`);
    ``worker_id``: names the worker in an elastic job (its membership signal)."""

    def __init__(self, host: str, port: int, secret: str, stage_id: int, worker_id: str = ""):
        self._sock = socket.create_connection((host, port), timeout=HANDSHAKE_TIMEOUT_S)
        #: this worker's address as the driver sees it (the one its peers can reach)
        self.local_address = str(self._sock.getsockname()[0])
        challenge = read_line(self._sock, 128)
        self._sock.sendall(f"{answer(secret, challenge)} {stage_id} {worker_id}\n".encode())
        #: the number the driver told this worker's group (Spark: the stage attempt)
        self.stage_attempt = int(read_line(self._sock, 32) or 0)
        self._sock.settimeout(None)
        self._lock = threading.Lock()
        _Progress.connection = self  # this worker's channel for report_progress()

    def send(self, tag: str, line: str) -> None:
        data = (tag + line + "\n").encode("utf-8", errors="replace")
        with self._lock:
            self._sock.sendall(data)

    def done(self) -> None:
        """Tell the driver this worker returned from its function (elastic jobs)."""
        self.send(DONE_TAG, "")

    def close(self) -> None:
        if _Progress.connection is self:
            _Progress.connection = None
            _Progress.reset()
        self._sock.close()


class PrefixedLines:
    """A text stream that prefixes every line with ``[rank]<name>:`` (Horovod's style),
    optionally after a timestamp, and hands complete lines to ``sink(tag, line)``.
    With no sink the lines go to ``fallback``. ``rank`` may be a callable giving the
    label at each line (elastic workers change rank between generations)."""

    def __init__(
        self,
        tag: str,
        rank: int | Callable[[], str],
        sink: LogConnection | None,
        fallback: Any,
        timestamps: bool = False,
    ):
        name = "stdout" if tag == STDOUT_TAG else "stderr"
        self._tag, self._name, self._rank = tag, name, rank
        self._sink, self._fallback, self._timestamps = sink, fallback, timestamps
        self._partial = ""
        self._lock = threading.Lock()

    def _emit(self, line: str) -> None:
        stamp = time.strftime(TIMESTAMP_FORMAT) if self._timestamps else ""
        label = self._rank() if callable(self._rank) else self._rank
        text = f"{stamp}[{label}]<{self._name}>:{line}"
        if self._sink is not None:
            try:
                self._sink.send(self._tag, text)
                return
            except OSError:
                self._sink = None  # the driver went away: keep the output locally
        self._fallback.write(text + "\n")

    def write(self, text: str) -> int:
        with self._lock:
            pieces = (self._partial + text).split("\n")
            self._partial = pieces.pop()
            for line in pieces:
                self._emit(line)
        return len(text)

    def flush(self) -> None:
        if self._sink is None:
            self._fallback.flush()

    def close(self) -> None:
        """Send a last unterminated line, if any."""
        with self._lock:
            if self._partial:
                self._emit(self._partial)
                self._partial = ""
        self.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:
        return "utf-8"


def connect_log(
    host: str, port: int, secret: str, stage_id: int, worker_id: str = ""
) -> LogConnection | None:
    """A connection to the driver's log server, or None (output then stays local; the
    reason is written to stderr)."""
    try:
        return LogConnection(host, port, secret, stage_id, worker_id)
    except (OSError, ValueError) as exc:
        sys.stderr.write(f"ringtrain: cannot reach the driver's log server {host}:{port}: {exc}\n")
        return None


def stream_pair(
    conn: LogConnection | None, rank: int | Callable[[], str], timestamps: bool
) -> tuple[Any, Any]:
    return (
        PrefixedLines(STDOUT_TAG, rank, conn, sys.stdout, timestamps),
        PrefixedLines(STDERR_TAG, rank, conn, sys.stderr, timestamps),
    )


#: rank 0 sends a progress line at most this often (and always the last step of ``total``)
PROGRESS_INTERVAL_S = 0.3


class _Progress:
    """This worker's progress state (one worker per process at a time)."""

    connection: LogConnection | None = None
    started: tuple[float, int] | None = None  # (time, step) of the first report
    last_sent = float("-inf")

    @classmethod
    def reset(cls) -> None:
        cls.started, cls.last_sent = None, float("-inf")


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"progress({name}=...) takes a finite number, got {value!r}")
    return float(value)


def report_progress(
    step: int, total: int | None = None, loss: float | None = None, **metrics: Any
) -> None:
    """Report this rank's training progress to the driver's progress bar.

    Call it from the function a launcher runs (``spark_runner.progress`` is this
    function), e.g. after every step:
    ``spark_runner.progress(step=i + 1, total=n, loss=loss.item())``. Only rank 0's
    reports are shown; the driver gets at most one every ``PROGRESS_INTERVAL_S`` seconds
    (the last step of ``total`` always), with the steps per second since the first
    report. ``metrics``: more numbers to show (``lr=0.01``). In a process with no
    connection to a log server it does nothing, so the same function runs anywhere.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise TypeError(f"progress(step=...) takes an integer >= 0, got {step!r}")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total < 1):
        raise TypeError(f"progress(total=...) takes an integer >= 1 or None, got {total!r}")
    value: dict[str, Any] = {"step": step, "total": total}
    if loss is not None:
        value["loss"] = _number("loss", loss)
    value.update({k: _number(k, v) for k, v in metrics.items()})
    conn = _Progress.connection
    if conn is None or os.environ.get(RANK_ENV_VAR, "0") != "0":
        return
    now = time.monotonic()
    if _Progress.started is None:
        _Progress.started = (now, step)
    last = total is not None and step >= total
    if now - _Progress.last_sent < PROGRESS_INTERVAL_S and not last:
        return
    _Progress.last_sent = now
    t0, s0 = _Progress.started
    if now > t0 and step > s0:
        value["steps_per_s"] = round((step - s0) / (now - t0), 3)
    try:
        conn.send(PROGRESS_TAG, json.dumps(value))
    except OSError:
        _Progress.connection = None  # the driver went away: training goes on
