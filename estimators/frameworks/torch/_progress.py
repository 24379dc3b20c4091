"""Rank 0's live progress of a torch fit: a callback feeding a ``StepReporter``.

The reporter (``estimators/tracking/_progress.py``) rewrites the run's ``progress.json``
and the TensorBoard scalars; this callback hands it each batch's loss and rows and each
epoch's history entry, after the user's callbacks.
"""

from __future__ import annotations

from typing import Any

from ..._callbacks import Callback
from ...tracking._progress import StepReporter

__all__ = ["abort_progress", "torch_progress_callbacks"]


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
