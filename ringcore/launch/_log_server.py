"""Log forwarding, the driver's side: a small authenticated TCP line server.

A launcher starts one :class:`LogServer` per job where its driver runs and tells each
worker its address and the job's log secret (``LogServer.secret``; never in a worker's
environment). Each worker connects (``ringcore.launch.LogConnection``), proves it knows
the secret by answering a random challenge with an HMAC (the secret never travels on
the socket), then streams text lines, each starting with ``O`` (stdout) or ``E``
(stderr), prefixed by its rank (``ringcore.launch.stream_pair``). The server writes
them to the ``stdout`` / ``stderr`` objects it was given. Only text is read from the
socket, never a pickle; a peer that fails the check is dropped before anything else is
read from it. Spark's tasks connect to it; so can any launcher's workers.

The connections are also the membership signal of an elastic job: a worker names its
id in the handshake, so the driver knows at once (the socket closes) when a worker's
process dies; a ``D`` line says that the worker returned from its function. A ``P``
line carries rank 0's progress (``ringcore.launch.report_progress``) as a JSON object,
handed to the ``on_progress`` callable (the driver's progress bar). A ``W`` line,
``W<ref> <signed blob>``, carries a failed worker's error (the codec,
``ringcore.launch.task_failure_text``): kept as text under its reference, decoded by
the driver only after its HMAC checks out. The handshake's reply is a number the
launcher hands each worker for its group (``attempt_of``: Spark's stage attempt).

The driver waits for the connections to end (:meth:`LogServer.drain`; each worker
closes its own as it ends) before it reads the errors or prints the job's end line, so
every line of the workers is written first, in the order each worker sent it.
"""

from __future__ import annotations

import json
import logging
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .._auth import answer, new_secret, verify
from ..engine.wire import bound_silence

log = logging.getLogger("ringtrain.ringcore.launch")

__all__ = [
    "DRAIN_S",
    "ERROR_TAG",
    "MAX_HANDSHAKES",
    "MAX_LINE_BYTES",
    "LogServer",
]

HANDSHAKE_TIMEOUT_S = 10.0
MAX_LINE_BYTES = 1 << 20
#: connections not yet authenticated at once; more are hung up on and counted (a flood
#: of strangers must not cost a thread each)
MAX_HANDSHAKES = 64
#: how long the driver waits, once a job ended, for the workers' connections to end (each
#: worker closes its own as it ends; Spark kills the tasks of a failed stage)
DRAIN_S = 5.0
#: how long the accept loop pauses after an error such as EMFILE (too many open files)
ACCEPT_RETRY_S = 0.1
STDOUT_TAG, STDERR_TAG, DONE_TAG = "O", "E", "D"
#: a line of rank 0's progress, a JSON object (``report_progress``)
PROGRESS_TAG = "P"
#: a line of a failed worker's error: ``W<ref> <signed blob>`` (``_worker_errors``)
ERROR_TAG = "W"


def read_line(sock: socket.socket, limit: int) -> str:
    """One handshake line from ``sock`` (at most ``limit`` bytes), stripped."""
    data = b""
    while not data.endswith(b"\n") and len(data) <= limit:
        chunk = sock.recv(1)
        if not chunk:
            break
        data += chunk
    return data.decode("ascii", errors="replace").strip()


class LogServer:
    """Receives the workers' output lines and writes them to ``stdout`` / ``stderr``.

    ``bind_host``: where it listens; ``advertised_host``: the address workers connect to
    (default ``bind_host``); ``attempt_of(group)``: the number each worker of ``group``
    is told in the handshake (default 0); ``on_progress``: gets each progress line's
    object."""

    def __init__(
        self,
        stdout: Any,
        stderr: Any,
        bind_host: str = "127.0.0.1",
        attempt_of: Callable[[int], int] | None = None,
        advertised_host: str | None = None,
        on_progress: Callable[[dict[str, Any]], None] | None = None,
    ):
        self.advertised_host = advertised_host or bind_host
        self._on_progress = on_progress  # gets each progress line's object
        self._attempt_of = attempt_of or (lambda stage_id: 0)
        self.secret = new_secret()  # the job's log secret: worker connections, error blobs
        self._targets = {STDOUT_TAG: stdout, STDERR_TAG: stderr}
        self._write_lock = threading.Lock()
        self._changed = threading.Condition(self._write_lock)  # a connection ended, an error came
        self._open = 0  # authenticated connections still being read
        self._errors: list[tuple[str, str]] = []  # (ref, signed blob) of W lines, as sent
        self._listener = socket.create_server((bind_host, 0))
        self._listener.settimeout(0.5)
        self.port = int(self._listener.getsockname()[1])
        self._closing = threading.Event()
        self._readers: list[threading.Thread] = []
        self._conns: list[socket.socket] = []
        self._handshaking = 0
        self.refused = 0  # connections hung up on: failed the check, or over MAX_HANDSHAKES
        self._workers: dict[str, str] = {}  # connected worker id -> host, in arrival order
        self._finished: set[str] = set()
        self._acceptor = threading.Thread(
            target=self._accept_loop, name="ringtrain-log-accept", daemon=True
        )
        self._acceptor.start()

    def __repr__(self) -> str:  # never show the secret
        return f"LogServer(port={self.port})"

    def _accept_loop(self) -> None:
        while not self._closing.is_set():
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:  # EMFILE, ENOBUFS, ...: the listener itself is fine
                if self._closing.is_set():
                    return
                log.warning("log server: accept failed (%s); retrying", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            with self._write_lock:
                self._prune()
                crowded = self._handshaking >= MAX_HANDSHAKES
                if crowded:
                    self.refused += 1
                else:
                    self._handshaking += 1
            if crowded:
                conn.close()
                continue
            bound_silence(conn)  # a lost host's worker leaves within RING_CONTROL_TIMEOUT_SECONDS
            self._conns.append(conn)
            reader = threading.Thread(
                target=self._serve, args=(conn, peer), name="ringtrain-log-reader", daemon=True
            )
            self._readers.append(reader)
            reader.start()

    def _prune(self) -> None:
        """Forget the readers that ended and their connections (lists never only grow)."""
        alive = [i for i, r in enumerate(self._readers) if r.is_alive()]
        self._readers = [self._readers[i] for i in alive]
        self._conns = [self._conns[i] for i in alive]

    def _authenticate(self, conn: socket.socket) -> tuple[str, int] | None:
        """Challenge and check the HMAC. Returns the worker id the peer named ("" for
        none) and its group's number (``attempt_of``), or None when it failed."""
        challenge = secrets.token_hex(16)
        conn.settimeout(HANDSHAKE_TIMEOUT_S)
        conn.sendall(challenge.encode() + b"\n")
        reply, _, rest = read_line(conn, 300).partition(" ")
        if not verify(answer(self.secret, challenge), reply):
            return None
        stage, _, worker_id = rest.partition(" ")
        try:
            return worker_id, self._attempt_of(int(stage))
        except Exception:
            return worker_id, 0

    def _serve(self, conn: socket.socket, peer: Any) -> None:
        worker_id: str | None = None
        passed: tuple[str, int] | None = None
        try:
            try:
                passed = self._authenticate(conn)
            finally:
                # Counted (and its worker listed) before the peer hears it passed: a
                # drain() that starts once the peer has sent its lines waits for them.
                with self._write_lock:
                    self._handshaking -= 1
                    if passed is not None:
                        worker_id = passed[0]
                        self._open += 1
                        if worker_id:
                            self._workers[worker_id] = str(peer[0])
            if passed is None:
                with self._write_lock:
                    self.refused += 1
                log.warning("rejected a log connection from %s: bad authentication", peer)
                return
            conn.sendall(f"{passed[1]}\n".encode())
            conn.settimeout(None)
            self._read_lines(conn, passed[0])
        except OSError as exc:
            log.debug("log connection from %s ended: %s", peer, exc)
        finally:
            with self._write_lock:
                if worker_id:
                    self._workers.pop(worker_id, None)
                if worker_id is not None:
                    self._open -= 1
                    self._changed.notify_all()
            conn.close()

    def _read_lines(self, conn: socket.socket, worker_id: str) -> None:
        """Handle each line until the worker closes; a line over MAX_LINE_BYTES is cut
        there and the rest of it skipped (never read as lines of its own)."""
        skipping = False
        with conn.makefile("r", encoding="utf-8", errors="replace", newline="\n") as lines:
            while True:
                line = lines.readline(MAX_LINE_BYTES)
                if not line:
                    return
                cut = not line.endswith("\n") and len(line) >= MAX_LINE_BYTES
                if not skipping:
                    self._handle(line, worker_id)
                skipping = cut or (skipping and not line.endswith("\n"))

    def _handle(self, line: str, worker_id: str) -> None:
        tag = line[:1]
        if tag == DONE_TAG:
            if worker_id:
                with self._write_lock:
                    self._finished.add(worker_id)
        elif tag == PROGRESS_TAG:
            self._progress(line[1:])
        elif tag == ERROR_TAG:
            ref, _, blob = line[1:].strip().partition(" ")
            with self._write_lock:
                self._errors.append((ref, blob))
                self._changed.notify_all()
        else:
            self._write(line)

    def workers(self) -> dict[str, str]:
        """The connected workers (id -> host) in the order they connected."""
        with self._write_lock:
            return dict(self._workers)

    def finished(self) -> set[str]:
        """The workers that said they returned from their function."""
        with self._write_lock:
            return set(self._finished)

    def _progress(self, text: str) -> None:
        """Hand a progress line's JSON object to ``on_progress`` (dropped without one, or
        when it is not an object: progress never fails the job)."""
        if self._on_progress is None:
            return
        try:
            value = json.loads(text)
        except ValueError:
            return
        if isinstance(value, dict):
            with self._write_lock:
                self._on_progress(value)

    def _write(self, line: str) -> None:
        target = self._targets.get(line[:1])
        if target is None:
            return
        text = line[1:] if line.endswith("\n") else line[1:] + "\n"
        with self._write_lock:
            target.write(text)
            flush = getattr(target, "flush", None)
            if flush is not None:
                flush()

    def drain(self, timeout_s: float = DRAIN_S) -> bool:
        """Wait until every worker's connection has ended and all it sent is handled (at
        most ``timeout_s``); whether they all did."""
        with self._changed:
            return self._changed.wait_for(lambda: self._open == 0, timeout=timeout_s)

    def wait_for_errors(self, refs: list[str], timeout_s: float) -> list[str]:
        """The signed error blobs sent under any of ``refs``, in the order of ``refs``:
        waits until one of them came, or no worker is connected, or ``timeout_s``."""

        def named() -> list[str]:
            sent = dict(self._errors)
            return [sent[r] for r in dict.fromkeys(refs) if r in sent]

        with self._changed:
            self._changed.wait_for(lambda: named() or self._open == 0, timeout=timeout_s)
            return named()

    def worker_errors(self) -> list[str]:
        """Every signed error blob the workers sent, in arrival order."""
        with self._write_lock:
            return [blob for _, blob in self._errors]

    def close(self, drain_s: float = DRAIN_S) -> None:
        """Stop accepting; give connected workers ``drain_s`` to finish their output."""
        self._closing.set()
        self._listener.close()
        self._acceptor.join(timeout=2.0)
        deadline = time.monotonic() + drain_s  # for all readers together, not each
        for reader in list(self._readers):
            reader.join(timeout=max(0.0, deadline - time.monotonic()))
        for conn in list(self._conns):
            conn.close()
