"""Live progress of a fit: rank 0 writes it, the driver shows it.

The channel is a small file in the store, ``<store>/runs/<run_id>/logs/progress.json``,
beside ``history.json``: rank 0's :class:`StepReporter` rewrites it atomically at most
every :data:`WRITE_INTERVAL_S` (and at every epoch's end) with ``{"epoch", "epochs",
"step", "steps", "loss", "rows_per_s"}``; the driver's poller (``_report``) reads it a
few times a second and feeds a :class:`ringcore.progress.ProgressDisplay`. The reporter
also writes the TensorBoard scalars (``_tensorboard``). Each framework feeds it from
its own loop on rank 0 (a torch callback, a Lightning callback, a Keras callback: so
Keras runs with ``verbose=0`` and still shows steps).

The display (a tqdm bar, the notebook widget, or plain lines) is ringcore.progress's,
shared with spark_runner and ray_runner. ``RING_PROGRESS=0`` turns it off everywhere;
the estimator's ``progress`` param does it for one fit.
"""

from __future__ import annotations

import contextlib
import posixpath
import time
from typing import Any

from ._tensorboard import ScalarWriter

__all__ = ["PROGRESS_FILE", "WRITE_INTERVAL_S", "StepReporter", "progress_path"]

PROGRESS_FILE = "progress.json"
#: rank 0 rewrites the progress file at most this often (and at every epoch's end)
WRITE_INTERVAL_S = 0.3


def progress_path(store: Any, run_id: str) -> str:
    return posixpath.join(store.get_logs_path(run_id), PROGRESS_FILE)


# --- rank 0 -------------------------------------------------------------------------


class StepReporter:
    """Rank 0's side: the progress file (throttled) and the TensorBoard scalars."""

    def __init__(self, store: Any, run_id: str, epochs: int, steps: int):
        self._store, self._path = store, progress_path(store, run_id)
        self._epochs, self._steps = int(epochs), int(steps)
        self._tb = ScalarWriter(store, run_id)
        self._epoch = 0
        self._rows = 0.0
        self._started = self._last_write = 0.0
        self._global_step = 0

    def begin_epoch(self, epoch: int) -> None:
        """``epoch`` counts from 0."""
        self._epoch, self._rows = epoch, 0.0
        self._global_step = epoch * self._steps
        self._started = time.monotonic()
        self._last_write = 0.0

    def step(self, step: int, loss: float, rows: float) -> None:
        """After batch ``step`` (from 0) of the epoch, with rank 0's loss and rows."""
        self._rows += rows
        self._global_step += 1
        self._tb.add("step/loss", loss, self._global_step)
        now = time.monotonic()
        if now - self._last_write >= WRITE_INTERVAL_S:
            self._last_write = now
            self._write(step + 1, loss, now)

    def end_epoch(self, epoch: int, entry: dict[str, Any]) -> None:
        self._write(self._steps, entry.get("train_loss"), time.monotonic())
        self._tb.add_epoch(entry)

    def close(self) -> None:
        self._tb.close()

    def abort(self) -> None:
        """The fit failed: release the event writer and its temporary folder."""
        self._tb.abort()

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
