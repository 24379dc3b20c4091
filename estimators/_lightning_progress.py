"""Live progress and TensorBoard scalars of a Lightning fit, as the torch loop's.

Rank 0 adds one small ``lightning`` Callback feeding a :class:`._progress.StepReporter`:
``progress.json`` (throttled) and the event files under ``<store>/runs/<run_id>/logs``,
with rank 0's batch loss (times the accumulation Lightning divided it by) and rows per
batch. An epoch's entry is appended to the history by the store callback, a Lightning
``Checkpoint`` that runs after every other callback's ``on_train_epoch_end``; so this
callback hands an epoch's entry to the reporter when the next epoch starts, or when
training ends.
"""

from __future__ import annotations

from typing import Any

from ._progress import StepReporter

__all__ = ["lightning_progress_callbacks"]


def lightning_progress_callbacks(
    pl: Any, spec: Any, rank: int, history: list[dict[str, Any]]
) -> list[Any]:
    """Rank 0's progress callback for ``pl.Trainer(callbacks=...)``, or none on other ranks."""
    if rank != 0:
        return []
    from ._train_lightning import _loss_of, _rows

    reporter = StepReporter(spec.store, spec.run_id, spec.epochs, spec.steps_per_epoch)
    done = [len(history)]  # entries already handed over (a resumed fit's earlier epochs)

    def hand_over() -> None:
        for entry in history[done[0] :]:
            reporter.end_epoch(int(entry["epoch"]) - 1, entry)
        done[0] = len(history)

    class _LightningProgress(pl.Callback):
        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            hand_over()
            reporter.begin_epoch(trainer.current_epoch)

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            loss = _loss_of(outputs)
            if loss is None:
                return
            if module.automatic_optimization:
                loss = loss * trainer.accumulate_grad_batches
            reporter.step(batch_idx, float(loss), float(_rows(spec, batch)))

        def on_train_end(self, trainer: Any, module: Any) -> None:
            hand_over()
            reporter.close()

        def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
            reporter.close()

    return [_LightningProgress()]
