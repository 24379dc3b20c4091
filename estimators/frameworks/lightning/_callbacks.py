"""The callbacks ringtrain adds to every rank's ``lightning.Trainer``.

- The store checkpoint (:func:`store_callback`), a Lightning ``Checkpoint``, so it runs
  after the module's ``on_train_epoch_end`` and after other callbacks: it turns each
  epoch into a history entry (``train_loss``: ``training_step``'s loss; ``val_loss``:
  ``validation_step``'s returned loss; ``train_<name>`` / ``val_<name>``: what
  ``self.log`` got; each a per-row mean over every rank, as the torch loop's history)
  and has rank 0 write the Store checkpoint: ``{"model": state_dict, "epoch",
  "history", "lightning": bytes}``, the last being Lightning's own checkpoint of that
  moment (optimizers, schedulers, loops, callbacks, precision) without the weights.
- ``terminate_on_nan`` (:func:`nan_callback`): after every training step the ranks agree
  whether any saw a non-finite loss or parameter, and all stop there with one error.
- Rank 0's live progress and TensorBoard scalars (:func:`progress_callbacks`), feeding a
  ``StepReporter`` with rank 0's batch loss (times the accumulation Lightning divided
  it by) and rows; an epoch's entry is handed over when the next epoch starts, or when
  training ends (the store callback appends it after every other callback).
"""

from __future__ import annotations

import io
import time
from collections.abc import Callable
from typing import Any

import torch

import ringcore.torch as hvd

from ...data._spec import DataSpec, writer
from ...tracking._progress import StepReporter
from ..torch._tensors import on_cpu
from ._log import LogRecorder, logged_means

__all__ = [
    "loss_of",
    "nan_callback",
    "on_rank_0",
    "progress_callbacks",
    "rows_of",
    "store_callback",
]


def rows_of(spec: DataSpec, batch: Any) -> int:
    try:
        return len(batch[spec.label_cols[0]])
    except (TypeError, KeyError, IndexError):
        return 1


def loss_of(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss.detach() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def store_callback(
    pl: Any, spec: DataSpec, recorder: LogRecorder, history: list[dict[str, Any]]
) -> Any:
    """The ``Checkpoint`` that turns each epoch into a history entry and has rank 0
    write the Store checkpoint (see the module docstring). A ``Checkpoint``: Lightning
    runs it after the module's ``on_train_epoch_end`` and after other callbacks."""

    class _StoreCheckpoint(pl.callbacks.Checkpoint):
        def __init__(self) -> None:
            self.train = torch.zeros(2, dtype=torch.float64)  # [loss * rows, rows]
            self.val = torch.zeros(2, dtype=torch.float64)
            self.started = time.monotonic()

        def on_train_epoch_start(self, trainer: Any, module: Any) -> None:
            self.train.zero_()
            self.val.zero_()
            self.started = time.monotonic()

        def on_train_batch_start(self, trainer, module, batch, batch_idx) -> None:
            recorder.weight = float(rows_of(spec, batch))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            recorder.weight = 1.0
            loss = loss_of(outputs)
            if loss is None:
                if module.automatic_optimization:
                    raise ValueError(
                        f"training_step returned no loss at epoch {trainer.current_epoch}, "
                        f"batch {batch_idx}; ringtrain does not skip steps (every rank steps "
                        "together). Return the loss."
                    )
                return
            if module.automatic_optimization:  # Lightning divides it by the accumulation
                loss = loss * trainer.accumulate_grad_batches
            rows = rows_of(spec, batch)
            self.train += torch.stack([loss.double().cpu() * rows, torch.tensor(rows).double()])

        def on_validation_batch_start(
            self, trainer, module, batch, batch_idx, dataloader_idx=0
        ) -> None:
            recorder.weight = float(rows_of(spec, batch))

        def on_validation_batch_end(
            self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0
        ) -> None:
            recorder.weight = 1.0
            loss = loss_of(outputs)
            if loss is not None and not trainer.sanity_checking:
                rows = rows_of(spec, batch)
                self.val += torch.stack([loss.double().cpu() * rows, torch.tensor(rows).double()])

        def on_train_epoch_end(self, trainer: Any, module: Any) -> None:
            sums = hvd.allreduce(
                torch.cat([self.train, self.val]), op=hvd.Sum, name="ringtrain.lightning.losses"
            ).tolist()
            entry: dict[str, Any] = {"epoch": trainer.current_epoch + 1}
            if sums[1] > 0:
                entry["train_loss"] = sums[0] / sums[1]
            if sums[3] > 0:
                entry["val_loss"] = sums[2] / sums[3]
            entry.update(logged_means(recorder))
            entry["seconds"] = round(time.monotonic() - self.started, 3)
            history.append(entry)
            # Lightning's own checkpoint of this moment, on every rank (hooks may sync)
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            on_rank_0(lambda: _save(spec, state, history), "ringtrain.lightning.saved")

    return _StoreCheckpoint()


def nan_callback(pl: Any) -> Any:
    """``terminate_on_nan`` (Horovod's LightningEstimator passed it to the Trainer of
    Lightning 1.x): after every training step the ranks agree whether any saw a
    non-finite loss or parameter, and all stop there with the same error."""

    class _TerminateOnNan(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            loss = loss_of(outputs)
            bad_loss = loss is not None and not bool(torch.isfinite(loss).all())
            bad_params = not all(bool(torch.isfinite(p).all()) for p in module.parameters())
            flags = torch.tensor([[int(bad_loss), int(bad_params)]], dtype=torch.int32)
            flags = hvd.allgather(flags, name="ringtrain.lightning.terminate_on_nan")
            if not bool(flags.any()):
                return
            what = []
            for column, name in ((0, "training loss"), (1, "parameters")):
                ranks = [r for r in range(len(flags)) if flags[r, column]]
                if ranks:
                    what.append(f"the {name} on rank(s) {ranks}")
            raise ValueError(
                f"terminate_on_nan: {' and '.join(what)} became NaN or infinite at epoch "
                f"{trainer.current_epoch}, batch {batch_idx} (global step "
                f"{trainer.global_step}); the fit stops there on every rank. Lower the "
                "learning rate, clip gradients (trainer_args={'gradient_clip_val': ...}) or "
                "check the data; the last complete epoch's checkpoint is in the store."
            )

    return _TerminateOnNan()


# Lightning checkpoint entries ringtrain does not keep: the weights are the outer
# "model"; the module's hyper-parameters come with the module itself.
_DROPPED = ("state_dict", "hyper_parameters", "hparams_name", "hparams_type")


def _save(spec: DataSpec, state: dict[str, Any], history: list[dict[str, Any]]) -> None:
    lightning = {k: v for k, v in state.items() if k not in _DROPPED}
    blob = io.BytesIO()
    torch.save(on_cpu(lightning), blob)
    checkpoint = {  # CPU copies: the driver (maybe without a GPU) loads this checkpoint
        "model": on_cpu(state["state_dict"]),
        "epoch": int(state["epoch"]) + 1,
        "history": list(history),
        "lightning": blob.getvalue(),
    }
    spec.store.write_checkpoint(spec.run_id, writer(spec), lambda f: torch.save(checkpoint, f))
    spec.store.write_json(spec.store.get_history_path(spec.run_id), list(history))


def on_rank_0(fn: Callable[[], Any], name: str) -> Any:
    """``fn()`` on rank 0, its result on every rank; when it raises (the store refuses a
    write, a newer attempt owns the run) every rank raises the same error, rather than
    the other ranks failing later on a collective rank 0 left."""
    outcome: tuple[Any, BaseException | None] = (None, None)
    error: Exception | None = None
    if hvd.rank() == 0:
        try:
            outcome = (fn(), None)
        except Exception as exc:
            error, outcome = exc, (None, exc)
    try:
        result, failure = hvd.broadcast_object(outcome, root_rank=0, name=name)
    except Exception:
        if error is not None:
            raise error from None
        raise
    if error is not None:
        raise error
    if failure is not None:
        raise failure
    return result


def progress_callbacks(pl: Any, spec: Any, rank: int, history: list[dict[str, Any]]) -> list[Any]:
    """Rank 0's progress callback for ``pl.Trainer(callbacks=...)``, or none on other ranks."""
    if rank != 0:
        return []
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
            loss = loss_of(outputs)
            if loss is None:
                return
            if module.automatic_optimization:
                loss = loss * trainer.accumulate_grad_batches
            reporter.step(batch_idx, float(loss), float(rows_of(spec, batch)))

        def on_train_end(self, trainer: Any, module: Any) -> None:
            hand_over()
            reporter.close()

        def on_exception(self, trainer: Any, module: Any, exception: BaseException) -> None:
            reporter.close()

    return [_LightningProgress()]
