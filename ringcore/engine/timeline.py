"""Horovod's timeline: a Chrome-trace JSON file (open it in chrome://tracing or
Perfetto) with one row per tensor, named as Horovod names it (``allreduce.<name>``),
and its phases — NEGOTIATE_<OP>, QUEUE, MEMCPY_IN_FUSION_BUFFER, the collective
itself (ALLREDUCE, ...), MEMCPY_OUT_FUSION_BUFFER — plus CYCLE_START marks.

As Horovod's, the file is readable while the job runs: the engine flushes it after
each cycle's ops, so it holds everything up to the last cycle (the closing ``]``
comes with ``stop()``; trace viewers accept the file without it)."""

from __future__ import annotations

import json
import os
import threading
import time
from typing import TextIO

__all__ = ["Timeline"]


class Timeline:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: TextIO | None = None
        self._first = True
        self._tids: dict[str, int] = {}
        self.mark_cycles = False
        self._t0 = time.perf_counter()

    @property
    def active(self) -> bool:
        return self._file is not None

    def start(self, path: str, mark_cycles: bool = False) -> None:
        with self._lock:
            self._close_locked()
            folder = os.path.dirname(os.path.abspath(path))
            os.makedirs(folder, exist_ok=True)
            handle = open(path, "w")  # noqa: SIM115 - held open while recording
            handle.write("[\n")
            self._file = handle
            self._first = True
            self._tids = {}
            self.mark_cycles = mark_cycles
            self._t0 = time.perf_counter()
            start_us = time.time_ns() // 1000
            self._write(
                {
                    "name": "process_name",
                    "ph": "M",
                    "pid": 0,
                    "tid": 0,
                    "args": {"name": "ringcore", "start_time_since_epoch_in_micros": start_us},
                }
            )
            handle.flush()

    def flush(self) -> None:
        """Make what was recorded so far readable by others (once per cycle)."""
        if self._file is None:
            return
        with self._lock:
            if self._file is not None:
                self._file.flush()

    def _us(self, t: float) -> float:
        return (t - self._t0) * 1e6

    def _write(self, event: dict) -> None:
        assert self._file is not None
        self._file.write(("" if self._first else ",\n") + json.dumps(event))
        self._first = False

    def _tid(self, name: str) -> int:
        tid = self._tids.get(name)
        if tid is None:
            tid = self._tids[name] = len(self._tids) + 1
            self._write(
                {"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": name}}
            )
        return tid

    def span(self, name: str, phase: str, start: float, end: float, **args) -> None:
        """One phase of one tensor, from perf_counter ``start`` to ``end``."""
        if self._file is None:
            return
        with self._lock:
            if self._file is None:
                return
            event = {
                "name": phase,
                "ph": "X",
                "pid": 0,
                "tid": self._tid(name),
                "ts": self._us(start),
                "dur": max(self._us(end) - self._us(start), 0.0),
            }
            if args:
                event["args"] = args
            self._write(event)

    def cycle(self, when: float) -> None:
        if self._file is None or not self.mark_cycles:
            return
        with self._lock:
            if self._file is not None:
                self._write(
                    {
                        "name": "CYCLE_START",
                        "ph": "i",
                        "s": "g",
                        "pid": 0,
                        "tid": 0,
                        "ts": self._us(when),
                    }
                )

    def _close_locked(self) -> None:
        if self._file is not None:
            self._file.write("\n]\n")
            self._file.close()
            self._file = None

    def stop(self) -> None:
        with self._lock:
            self._close_locked()
