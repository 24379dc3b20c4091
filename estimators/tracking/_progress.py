"""Rank 0's live record of a fit's steps: the progress file and the TensorBoard scalars.

:class:`StepReporter` feeds the run-services layer's :class:`ringcore.runs.ProgressFile`
(``<store>/runs/<run_id>/logs/progress.json``, which the driver's ``_report`` shows) and
:class:`ringcore.runs.ScalarWriter` (``step/loss`` at the global step, ``epoch/<name>``
per epoch). Each framework feeds it from its own loop on rank 0 (a torch callback, a
Lightning callback, a Keras callback: so Keras runs with ``verbose=0`` and still shows
steps). ``RING_PROGRESS=0`` turns the driver's display off everywhere; the estimator's
``progress`` param does it for one fit.
"""

from __future__ import annotations

from typing import Any

from ringcore.runs import ProgressFile, ScalarWriter

__all__ = ["StepReporter"]


class StepReporter:
    """Rank 0's side: the progress file (throttled) and the TensorBoard scalars."""

    def __init__(self, store: Any, run_id: str, epochs: int, steps: int):
        self._file = ProgressFile(store, run_id, epochs, steps)
        self._tb = ScalarWriter(store, run_id)
        self._steps = int(steps)
        self._global_step = 0

    def begin_epoch(self, epoch: int) -> None:
        """``epoch`` counts from 0."""
        self._file.begin_epoch(epoch)
        self._global_step = epoch * self._steps

    def step(self, step: int, loss: float, rows: float) -> None:
        """After batch ``step`` (from 0) of the epoch, with rank 0's loss and rows."""
        self._global_step += 1
        self._tb.add("step/loss", loss, self._global_step)
        self._file.step(step, loss, rows)

    def end_epoch(self, epoch: int, entry: dict[str, Any]) -> None:
        self._file.end_epoch(entry.get("train_loss"))
        self._tb.add_epoch(entry)

    def close(self) -> None:
        self._tb.close()

    def abort(self) -> None:
        """The fit failed: release the event writer and its temporary folder."""
        self._tb.abort()
