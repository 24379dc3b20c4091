"""Live progress of a run kept in a store: rank 0 writes it, the driver reads it.

The channel is a small file in the store, ``<store>/runs/<run_id>/logs/progress.json``,
beside ``history.json``: rank 0's :class:`ProgressFile` rewrites it atomically at most
every :data:`WRITE_INTERVAL_S` (and at every epoch's end) with ``{"epoch", "epochs",
"step", "steps", "loss", "rows_per_s"}``. On the driver, :class:`RunWatcher` polls both
files from one daemon thread every :data:`POLL_S`: each new epoch of the history is
printed once (through ``line``) and handed to ``on_epoch`` (MLflow's live logging), and
the latest progress goes to a :class:`ringcore.progress.ProgressDisplay` (a bar, or
plain lines). When the run's history comes back, what is left is printed and handed on.
Worker output itself may not reach the driver's stdout (Spark's local mode); the store
always does.

The display is :mod:`ringcore.progress`'s, shared with every launcher; ray_runner feeds
it from rank 0's reports as they reach the driver instead of from a file.
"""

from __future__ import annotations

import contextlib
import json
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

from ringcore.progress import ProgressDisplay

__all__ = ["POLL_S", "WRITE_INTERVAL_S", "ProgressFile", "RunWatcher"]

#: rank 0 rewrites the progress file at most this often (and at every epoch's end)
WRITE_INTERVAL_S = 0.3
#: how often the driver reads the history and progress files (a few updates a second)
POLL_S = 0.3


class ProgressFile:
    """Rank 0's progress file of one run (throttled, best effort: a store that fails is
    reported by the checkpoint's write, not here)."""

    def __init__(self, store: Any, run_id: str, epochs: int, steps: int):
        self._store, self._path = store, store.get_progress_path(run_id)
        self._epochs, self._steps = int(epochs), int(steps)
        self._epoch = 0
        self._rows = 0.0
        self._started = self._last_write = 0.0

    def begin_epoch(self, epoch: int) -> None:
        """``epoch`` counts from 0."""
        self._epoch, self._rows = epoch, 0.0
        self._started = time.monotonic()
        self._last_write = 0.0

    def step(self, step: int, loss: float, rows: float) -> None:
        """After batch ``step`` (from 0) of the epoch, with rank 0's loss and rows."""
        self._rows += rows
        now = time.monotonic()
        if now - self._last_write >= WRITE_INTERVAL_S:
            self._last_write = now
            self._write(step + 1, loss, now)

    def end_epoch(self, loss: Any) -> None:
        """The epoch's last step, with its loss (None: none)."""
        self._write(self._steps, loss, time.monotonic())

    def _write(self, step: int, loss: Any, now: float) -> None:
        elapsed = max(now - self._started, 1e-9)
        value = {
            "epoch": self._epoch + 1,
            "epochs": self._epochs,
            "step": int(step),
            "steps": self._steps,
            "loss": None if loss is None else float(loss),
            "rows_per_s": round(self._rows / elapsed, 1),
        }
        with contextlib.suppress(OSError):  # best effort: the checkpoint reports a broken store
            self._store.write_json(self._path, value)


class RunWatcher:
    """Context manager printing each epoch of a run exactly once (with ``line(entry)``;
    None: no lines), showing rank 0's progress (``progress``) and calling
    ``on_epoch(entry)`` for each new epoch (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        run_id: str,
        *,
        line: Callable[[dict[str, Any]], str] | None = None,
        out: TextIO | None = None,
        progress: bool = False,
        on_epoch: Callable[[dict[str, Any]], None] | None = None,
    ):
        self._store = store
        self._path = store.get_history_path(run_id)
        self._progress_path = store.get_progress_path(run_id)
        self._line = line
        self._out = out or sys.stdout
        self._on_epoch = on_epoch
        self._lock = threading.Lock()
        self._stop = threading.Event()
        earlier = list(self._read(self._path))  # epochs of an earlier fit of this run_id
        self._printed = len(earlier)
        self._last_epoch = int(earlier[-1].get("epoch", 0)) if earlier else 0
        self._seen_progress = self._read(self._progress_path, None)  # an earlier fit's
        self.display = ProgressDisplay(self._out) if progress else None
        self._thread: threading.Thread | None = None

    def _read(self, path: str, empty: Any = ()) -> Any:
        try:
            return self._store.read_json(path)
        except (OSError, json.JSONDecodeError):
            return list(empty) if isinstance(empty, tuple) else empty

    def _print_new(self, history: list[dict[str, Any]]) -> None:
        with self._lock:
            for entry in history[self._printed :]:
                if self._line is not None:
                    line = self._line(entry)
                    if self.display is not None:
                        self.display.write(line)
                    else:
                        print(line, file=self._out, flush=True)
                if self._on_epoch is not None:
                    self._on_epoch(entry)
                self._last_epoch = int(entry.get("epoch", self._last_epoch))
            self._printed = max(self._printed, len(history))

    def _show_progress(self, progress: Any) -> None:
        if isinstance(progress, dict) and progress != self._seen_progress:
            self._seen_progress = None  # from now on every change is this run's
            with self._lock:
                if self.display is not None:
                    self.display.update(progress)

    def _emit(self, progress: Any, history: list[dict[str, Any]], final: bool = False) -> None:
        """The epoch lines of ``history`` not printed yet and rank 0's ``progress``, in
        the order they happened: the epochs before the progress's own, the progress,
        then the rest. A plain progress line whose epoch's line is out already (read
        before rank 0 wrote that epoch's history) is stale and not shown; ``final``:
        the progress gets its plain line now (the last step)."""
        epoch = progress.get("epoch") if isinstance(progress, dict) else None
        if self.display is None or not isinstance(epoch, int):
            self._print_new(history)
            if self.display is not None:
                self._show_progress(progress)
            return
        self._print_new([e for e in history if e.get("epoch", 0) < epoch])
        if epoch > self._last_epoch or self.display.kind != "plain":
            self._show_progress(progress)
            if final:
                self.display.flush()
        self._print_new(history)

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            # progress read before the history: rank 0 writes a step's progress before
            # the history of its epoch's end, so what is read is in order (_emit)
            progress = self._read(self._progress_path, None) if self.display else None
            self._emit(progress, list(self._read(self._path)))

    def __enter__(self) -> RunWatcher:
        if self.display is not None:
            self.display.open()
        if self._line is not None or self.display is not None or self._on_epoch is not None:
            self._thread = threading.Thread(
                target=self._poll, name="ringtrain-history", daemon=True
            )
            self._thread.start()
        return self

    def finish(self, history: list[dict[str, Any]]) -> None:
        """Stop polling, then print (and hand on) the epochs of ``history`` not seen yet
        and rank 0's last progress, in order; every line is out when this returns."""
        self._stop_polling()
        progress = self._read(self._progress_path, None) if self.display else None
        self._emit(progress, history, final=True)  # the last step, after the poller's look
        self._close()

    def _stop_polling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _close(self) -> None:
        self._stop_polling()
        if self.display is not None:
            self.display.close()

    def __exit__(self, *exc: object) -> None:
        self._close()
