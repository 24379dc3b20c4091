"""Live progress of a fit: rank 0 writes it, the driver shows it.

The channel is a small file in the store, ``<store>/runs/<run_id>/logs/progress.json``,
beside ``history.json``: rank 0's :class:`StepReporter` rewrites it atomically at most
every :data:`WRITE_INTERVAL_S` (and at every epoch's end) with ``{"epoch", "epochs",
"step", "steps", "loss", "rows_per_s"}``; the driver's poller (``_report``) reads it a
few times a second and feeds a :class:`ringcore.progress.ProgressDisplay`. The reporter also writes the
TensorBoard scalars (``_tensorboard``). Torch and Lightning fits get it as a callback of
rank 0; Keras fits as a Keras callback (so Keras runs with ``verbose=0`` and still
shows steps).

The display (a tqdm bar, the notebook widget, or plain lines) is ringcore.progress's,
shared with spark_runner and ray_runner. ``RING_PROGRESS=0`` turns it off everywhere;
the estimator's ``progress`` param does it for one fit.
"""

from __future__ import annotations

import contextlib
import posixpath
import time
from typing import Any

from ringcore.progress import progress_enabled

from ._callbacks import Callback
from ._tensorboard import ScalarWriter

__all__ = [
    "PROGRESS_FILE",
    "WRITE_INTERVAL_S",
    "StepReporter",
    "keras_progress_callbacks",
    "progress_enabled",
    "progress_path",
    "torch_progress_callbacks",
]

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


class _TorchProgress(Callback):
    """The torch loop's hooks onto a :class:`StepReporter` (rank 0 only)."""

    def __init__(self, reporter: StepReporter):
        self._reporter = reporter

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        self._reporter.begin_epoch(epoch)

    def on_batch_end(self, batch: int, logs: dict[str, Any]) -> None:
        self._reporter.step(batch, logs["loss"], logs["rows"])

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        self._reporter.end_epoch(epoch, logs)

    def on_train_end(self, logs: dict[str, Any]) -> None:
        self._reporter.close()

    def abort(self) -> None:
        self._reporter.abort()


def abort_progress(callbacks: Any) -> None:
    """After a failed torch loop: release rank 0's reporter (its temp folder) at once."""
    for callback in getattr(callbacks, "callbacks", []):
        if isinstance(callback, _TorchProgress):
            callback.abort()


def torch_progress_callbacks(spec: Any, rank: int) -> list[Any]:
    """The callbacks a torch worker adds after the user's: rank 0's reporter, or none."""
    if rank != 0:
        return []
    return [
        _TorchProgress(StepReporter(spec.store, spec.run_id, spec.epochs, spec.steps_per_epoch))
    ]


def keras_progress_callbacks(spec: Any, rank: int, history: list[dict[str, Any]]) -> list[Any]:
    """A Keras callback of rank 0 feeding a :class:`StepReporter` (Keras's ``loss`` in
    ``logs`` is the epoch's running mean), or none on other ranks. It goes after the
    callback that appends each epoch's entry to ``history``."""
    if rank != 0:
        return []
    import keras

    reporter = StepReporter(spec.store, spec.run_id, spec.epochs, spec.steps_per_epoch)
    batch_size = float(spec.batch_size)

    class KerasProgress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            reporter.begin_epoch(epoch)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            reporter.step(batch, float((logs or {}).get("loss", float("nan"))), batch_size)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if history:
                reporter.end_epoch(epoch, history[-1])

        def on_train_end(self, logs: Any = None) -> None:
            reporter.close()

    return [KerasProgress()]
