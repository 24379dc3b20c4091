"""The ranks' processes: started, their output prefixed, waited for, ended as one job.

Each rank is a process in a process group of its own (a new session): on this host the
command itself, on another host the ``ssh`` client that runs ``ringrun._remote`` there
(see :mod:`ringrun._ssh`). Two threads per rank copy its stdout and stderr line by line
to ringrun's, each line whole and prefixed ``[rank]<stdout>:`` / ``[rank]<stderr>:``
(Horovod's). :meth:`Job.wait` returns when every rank exited 0, or when the first one
failed: then it ends the others and returns that rank's status. :meth:`Job.end` sends a
signal to every rank's whole group (a remote rank: the signal's name on ssh's input,
which ``ringrun._remote`` sends to the rank's group there), then SIGKILL after a grace.
"""

from __future__ import annotations

import contextlib
import json
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import IO, Any

from ringcore.launch import TERM_GRACE_S, die_with_parent, signal_group

from ._remote import exit_status

__all__ = ["Job", "Rank"]

_write_lock = threading.Lock()


def _pump(source: IO[bytes], sink: Any, prefix: bytes) -> None:
    """Copy ``source``'s lines to ``sink`` (a binary stream), each whole and prefixed."""
    for raw in iter(source.readline, b""):
        line = raw if raw.endswith(b"\n") else raw + b"\n"
        with _write_lock:
            sink.write(prefix + line)
            sink.flush()
    source.close()


class Rank:
    """One rank's process: the command (this host) or its ssh client (another host)."""

    def __init__(self, rank: int, host: str, argv: Sequence[str], env: dict[str, str] | None,
                 remote_spec: dict | None = None):  # fmt: skip
        self.rank, self.host = rank, host
        self.remote = remote_spec is not None
        self.proc = subprocess.Popen(
            list(argv),
            env=env,
            stdin=subprocess.PIPE if self.remote else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        if self.remote:
            self._tell(json.dumps(remote_spec))
        self.pumps = [
            threading.Thread(
                target=_pump, args=(stream, sink, f"[{rank}]<{tag}>:".encode()), daemon=True
            )
            for stream, sink, tag in (
                (self.proc.stdout, sys.stdout.buffer, "stdout"),
                (self.proc.stderr, sys.stderr.buffer, "stderr"),
            )
        ]
        for t in self.pumps:
            t.start()

    def _tell(self, line: str) -> None:
        try:
            self.proc.stdin.write(line.encode() + b"\n")  # type: ignore[union-attr]
            self.proc.stdin.flush()  # type: ignore[union-attr]
        except (BrokenPipeError, ValueError, OSError):  # ssh has exited
            pass

    def signal(self, sig: int) -> None:
        """``sig`` to the rank's whole group (here, or on its host through ssh's input)."""
        if self.proc.poll() is not None:
            return
        if not self.remote:
            signal_group(self.proc.pid, sig)
            return
        self._tell(signal.Signals(sig).name[3:])
        if sig != signal.SIGINT:
            with contextlib.suppress(OSError):  # EOF: ends the group there
                self.proc.stdin.close()  # type: ignore[union-attr]

    def kill(self) -> None:
        signal_group(self.proc.pid, signal.SIGKILL)


class Job:
    """Every rank of one ringrun call."""

    def __init__(self) -> None:
        self.ranks: list[Rank] = []
        self._exits: queue.Queue[tuple[int, int]] = queue.Queue()

    def add(self, rank: Rank) -> None:
        self.ranks.append(rank)
        threading.Thread(target=self._wait_one, args=(rank,), daemon=True).start()

    def _wait_one(self, rank: Rank) -> None:
        self._exits.put((rank.rank, rank.proc.wait()))

    def exited(self, timeout_s: float) -> list[tuple[int, int]]:
        """``(rank, status)`` of every rank that exited since the last call (waiting up
        to ``timeout_s`` for the first): for a launcher that watches the ranks itself."""
        out: list[tuple[int, int]] = []
        try:
            out.append(self._exits.get(timeout=timeout_s))
            while True:
                out.append(self._exits.get_nowait())
        except queue.Empty:
            return out

    def wait(self) -> int:
        """0 when every rank exited 0; else the first failing rank's status, after the
        other ranks were ended (SIGTERM to their groups, SIGKILL after the grace)."""
        pending = {r.rank for r in self.ranks}
        while pending:
            try:
                rank, code = self._exits.get(timeout=1.0)
            except queue.Empty:
                continue
            pending.discard(rank)
            if code != 0:
                failed = self.ranks[rank]
                how = f"was ended by signal {-code}" if code < 0 else f"exited with code {code}"
                print(
                    f"ringrun: rank {rank} on {failed.host} {how}; ending the other ranks",
                    file=sys.stderr,
                    flush=True,
                )
                self.end(signal.SIGTERM)
                return exit_status(code)
        self.drain()
        return 0

    def end(self, sig: int, grace_s: float = TERM_GRACE_S) -> None:
        """``sig`` to every rank still running, SIGKILL to those left after ``grace_s``."""
        for r in self.ranks:
            r.signal(sig)
        deadline = time.monotonic() + grace_s
        for r in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(max(0.0, deadline - time.monotonic()))
        for r in self.ranks:
            r.kill()  # the group: what the rank started and left behind too
        for r in self.ranks:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(5.0)
        self.drain()

    def drain(self, timeout_s: float = 5.0) -> None:
        """Wait until every line the ranks wrote is printed."""
        deadline = time.monotonic() + timeout_s
        for r in self.ranks:
            for t in r.pumps:
                t.join(max(0.0, deadline - time.monotonic()))
