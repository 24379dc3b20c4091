"""The Lightning worker: the user's LightningModule under a real ``lightning.Trainer``.

Every Spark task forms the ring (``ringcore.init()``), then fits the module with
``Trainer(strategy=RingStrategy, devices=1, max_epochs=epochs, ...)`` on its own shard
(``_lightning_strategy.py``: the ranks are the ring's, gradients averaged after every
backward). The batches come from the same Parquet readers as the torch loop (per-rank
shards, ``steps_per_epoch`` steps on every rank, shuffled by ``(random_seed, epoch)``),
as dicts ``{column: tensor}``; so ``self.trainer``, ``self.current_epoch``,
``self.global_step``, ``self.log`` (and ``sync_dist``), callbacks, loggers, profilers,
precision, gradient clipping, accumulation and manual optimization with several
optimizers are Lightning's own.

ringtrain adds one ``Checkpoint`` callback (:func:`_store_callback`). After each epoch
it appends the history entry (``train_loss``: ``training_step``'s loss; ``val_loss``:
``validation_step``'s returned loss; ``train_<name>`` / ``val_<name>``: what
``self.log`` got in training / validation; each a per-row mean over every rank, as the
torch loop's history) and has rank 0 write the Store checkpoint (as the torch loop: rank
0 claims the run as this fit's stage attempt first, and a write after a newer attempt
claimed it raises ``StaleWriterError``, writing nothing): ``{"model":
state_dict, "epoch", "history", "lightning": bytes}``, the last being Lightning's own
checkpoint of that moment (optimizers, schedulers, loops, callbacks, precision) without
the weights. A resumed ``run_id`` hands it back to ``trainer.fit(ckpt_path=...)``, so
the Trainer goes on at the next epoch with ``global_step``, optimizer and scheduler
states where they were. ``terminate_on_nan`` adds a callback that stops every rank
together at the first step whose loss or parameters are not finite.
"""

from __future__ import annotations

import io
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np
import torch

import ringcore.torch as hvd

from ._lightning import LogRecorder, check_reserved_trainer_args, overrides
from ._lightning_progress import lightning_progress_callbacks
from ._readers import ValidationShard
from ._spec import writer
from ._train_torch import (
    TrainSpec,
    _columns,
    _device,
    _epoch_batches,
    _epoch_seed,
    _load_shard,
    _load_validation,
    _local_copies,
    _logged_means,
    _memory_batches,
    _on_cpu,
    _tensor,
    _transformed,
    _val_batches,
)

__all__ = [
    "LightningTrainSpec",
    "check_trainer_args",
    "train_lightning",
]


@dataclass(frozen=True, kw_only=True)
class LightningTrainSpec(TrainSpec):
    """A :class:`TrainSpec` plus the Trainer's knobs (Horovod LightningEstimator's)."""

    trainer_args: dict[str, Any] = field(default_factory=dict)
    logger: Any = None  # a lightning logger (or a list of them); None / False: none
    log_every_n_steps: int = 50
    terminate_on_nan: bool = False
    profiler: Any = None


def check_trainer_args(
    trainer_args: dict[str, Any], backward_passes_per_step: int, trainer_cls: Any = None
) -> None:
    """Raise ValueError for a reserved key, for a key ``trainer_cls.__init__`` does not
    take (when given), and for ``accumulate_grad_batches`` against another
    ``backward_passes_per_step``."""
    check_reserved_trainer_args(trainer_args)
    if trainer_cls is not None:
        import inspect

        accepted = set(inspect.signature(trainer_cls.__init__).parameters) - {"self"}
        unknown = sorted(set(trainer_args) - accepted)
        if unknown:
            raise ValueError(
                f"trainer_args has {', '.join(map(repr, unknown))}, which "
                f"{trainer_cls.__module__.split('.trainer')[0]}.Trainer does not take; pass "
                "its keyword arguments only (e.g. precision, gradient_clip_val)."
            )
    accumulate = trainer_args.get("accumulate_grad_batches")
    if accumulate is not None and backward_passes_per_step not in (1, accumulate):
        raise ValueError(
            f"trainer_args sets accumulate_grad_batches={accumulate!r} and "
            f"backward_passes_per_step={backward_passes_per_step}; both set the backward "
            "passes per optimizer step. Pass one of them."
        )


# --- batches -----------------------------------------------------------------------------


def _batch(spec: TrainSpec, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``{column: tensor}``: features float32, labels and weights as stored."""
    tensors = {c: _tensor(batch[c]) for c in _columns(spec)}
    for c in spec.feature_cols:
        tensors[c] = tensors[c].to(torch.float32)
    return tensors


def _rows(spec: TrainSpec, batch: Any) -> int:
    try:
        return len(batch[spec.label_cols[0]])
    except (TypeError, KeyError, IndexError):
        return 1


class _TrainBatches:
    """The epoch's ``steps_per_epoch`` batches of this rank's shard (an iterable the
    Trainer takes as its train dataloader). The epoch is the Trainer's, so a resumed fit
    reads what an uninterrupted one would."""

    def __init__(self, spec: TrainSpec, train_path: str, cached: Any, module: Any) -> None:
        self.spec, self.train_path, self.cached, self.module = spec, train_path, cached, module

    def __len__(self) -> int:
        return self.spec.steps_per_epoch

    def __iter__(self):
        spec = self.spec
        epoch = int(self.module.trainer.current_epoch)
        torch.manual_seed(_epoch_seed(spec, epoch, hvd.rank()))
        if self.cached is not None:
            batches = _memory_batches(spec, self.cached, epoch)
        else:
            batches = _epoch_batches(spec, self.train_path, epoch)
        try:
            for step in range(spec.steps_per_epoch):
                batch = next(batches, None)
                if batch is None:
                    raise RuntimeError(
                        f"the training reader of {spec.train_path} gave no batch at step "
                        f"{step}; this rank's shard is empty"
                    )
                yield _batch(spec, _transformed(spec, batch))
        finally:
            batches.close()  # stops the epoch's reader (petastorm's threads)


class _ValBatches:
    """This rank's validation shard (streamed from the store) in ``val_batch_size`` batches."""

    def __init__(self, spec: TrainSpec, data: ValidationShard) -> None:
        self.spec, self.data = spec, data

    def __len__(self) -> int:
        return len(self.data)  # val_steps at most

    def __iter__(self):
        for batch in _val_batches(self.spec, self.data):
            yield _batch(self.spec, batch)


# --- self.log into the history -----------------------------------------------------------


def _mirror_log(module: Any, recorder: LogRecorder) -> None:
    """``module.log`` goes on to Lightning's own and also records the value for the
    history (``train_<name>`` / ``val_<name>``, weighted by the batch's rows);
    ``log_dict`` calls ``log``."""
    lightning_log = module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        result = lightning_log(name, value, *args, **kwargs)
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and trainer.sanity_checking:
            return result
        scalar = isinstance(value, float | int) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
        )
        if scalar:
            recorder.phase = "val" if trainer is not None and trainer.validating else "train"
            recorder.log(name, value)
        return result

    module.log = log  # an instance attribute shadows the method


def _loss_of(outputs: Any) -> torch.Tensor | None:
    loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
    return loss.detach() if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


# --- the callbacks -----------------------------------------------------------------------


def _store_callback(
    pl: Any, spec: TrainSpec, recorder: LogRecorder, history: list[dict[str, Any]]
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
            recorder.weight = float(_rows(spec, batch))

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            recorder.weight = 1.0
            loss = _loss_of(outputs)
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
            rows = _rows(spec, batch)
            self.train += torch.stack([loss.double().cpu() * rows, torch.tensor(rows).double()])

        def on_validation_batch_start(
            self, trainer, module, batch, batch_idx, dataloader_idx=0
        ) -> None:
            recorder.weight = float(_rows(spec, batch))

        def on_validation_batch_end(
            self, trainer, module, outputs, batch, batch_idx, dataloader_idx=0
        ) -> None:
            recorder.weight = 1.0
            loss = _loss_of(outputs)
            if loss is not None and not trainer.sanity_checking:
                rows = _rows(spec, batch)
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
            entry.update(_logged_means(recorder))
            entry["seconds"] = round(time.monotonic() - self.started, 3)
            history.append(entry)
            # Lightning's own checkpoint of this moment, on every rank (hooks may sync)
            state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            _on_rank_0(lambda: _save(spec, state, history), "ringtrain.lightning.saved")

    return _StoreCheckpoint()


def _nan_callback(pl: Any) -> Any:
    """``terminate_on_nan`` (Horovod's LightningEstimator passed it to the Trainer of
    Lightning 1.x): after every training step the ranks agree whether any saw a
    non-finite loss or parameter, and all stop there with the same error."""

    class _TerminateOnNan(pl.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
            loss = _loss_of(outputs)
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


# --- the store checkpoint ----------------------------------------------------------------

# Lightning checkpoint entries ringtrain does not keep: the weights are the outer
# "model"; the module's hyper-parameters come with the module itself.
_DROPPED = ("state_dict", "hyper_parameters", "hparams_name", "hparams_type")


def _save(spec: TrainSpec, state: dict[str, Any], history: list[dict[str, Any]]) -> None:
    lightning = {k: v for k, v in state.items() if k not in _DROPPED}
    blob = io.BytesIO()
    torch.save(_on_cpu(lightning), blob)
    checkpoint = {  # CPU copies: the driver (maybe without a GPU) loads this checkpoint
        "model": _on_cpu(state["state_dict"]),
        "epoch": int(state["epoch"]) + 1,
        "history": list(history),
        "lightning": blob.getvalue(),
    }
    spec.store.write_checkpoint(spec.run_id, writer(spec), lambda f: torch.save(checkpoint, f))
    spec.store.write_json(spec.store.get_history_path(spec.run_id), list(history))


def _on_rank_0(fn: Callable[[], Any], name: str) -> Any:
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


def _read_resume_state(spec: TrainSpec) -> tuple[int, list[dict[str, Any]], bytes | None]:
    """Rank 0: claim the run for this attempt, then ``(epochs done, history, Lightning
    checkpoint bytes or None)`` of its checkpoint when there is one."""
    spec.store.claim_run(spec.run_id, writer(spec))  # this attempt writes the run from now on
    path = spec.store.find_checkpoint(spec.run_id)
    if path is None:
        return 0, [], None
    checkpoint = torch.load(
        io.BytesIO(spec.store.read_bytes(path)), weights_only=True, map_location="cpu"
    )
    if not isinstance(checkpoint.get("lightning"), bytes):
        raise ValueError(
            f"the checkpoint of run {spec.run_id!r} at {path} holds no Lightning "
            "Trainer state (an older ringtrain trained this LightningModule without a "
            "Trainer), so it cannot be resumed; pick a new run_id, or delete "
            f"{spec.store.get_run_path(spec.run_id)} to start over."
        )
    lightning = torch.load(io.BytesIO(checkpoint["lightning"]), weights_only=True)
    lightning["state_dict"] = checkpoint["model"]
    blob = io.BytesIO()
    torch.save(lightning, blob)
    return int(checkpoint["epoch"]), list(checkpoint["history"]), blob.getvalue()


def _resume_state(spec: TrainSpec) -> tuple[int, list[dict[str, Any]], bytes | None]:
    """What rank 0 read (:func:`_read_resume_state`), on every rank."""
    return _on_rank_0(lambda: _read_resume_state(spec), "ringtrain.lightning.resume")


# --- the Trainer -------------------------------------------------------------------------


def _trainer(pl: Any, spec: LightningTrainSpec, device: torch.device, callbacks: list) -> Any:
    from ._lightning_strategy import ring_strategy

    check_trainer_args(spec.trainer_args, spec.backward_passes_per_step)
    kwargs: dict[str, Any] = {
        "logger": spec.logger if spec.logger is not None else False,
        "log_every_n_steps": spec.log_every_n_steps,
        "profiler": spec.profiler,
        "accumulate_grad_batches": spec.backward_passes_per_step,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "num_sanity_val_steps": 0,
        "use_distributed_sampler": False,
        "default_root_dir": os.getcwd(),
        **spec.trainer_args,
    }
    return pl.Trainer(
        strategy=ring_strategy(pl, device),
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        num_nodes=1,
        max_epochs=spec.epochs,
        enable_checkpointing=True,  # the store callback is a Checkpoint
        callbacks=callbacks,
        **kwargs,
    )


def train_lightning(spec: LightningTrainSpec) -> list[dict[str, Any]] | None:
    """Fit the LightningModule on this rank's shard; rank 0 returns the history."""
    from ._lightning_strategy import lightning_package

    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    module, _, _, _, user_callbacks = cloudpickle.loads(spec.user_objects)
    pl = lightning_package(module)
    start, history, resume = _resume_state(spec)
    if start >= spec.epochs:
        return history if hvd.rank() == 0 else None
    recorder = LogRecorder()
    _mirror_log(module, recorder)
    callbacks = [*user_callbacks, _store_callback(pl, spec, recorder, history)]
    callbacks += lightning_progress_callbacks(pl, spec, hvd.rank(), history)  # rank 0: progress, TB
    if spec.terminate_on_nan:
        callbacks.append(_nan_callback(pl))
    device = _device(spec)
    with tempfile.TemporaryDirectory(prefix="ringtrain-lightning-") as work:
        ckpt_path = None
        if resume is not None:
            ckpt_path = os.path.join(work, "resume.ckpt")
            with open(ckpt_path, "wb") as f:
                f.write(resume)
        trainer = _trainer(pl, spec, device, callbacks)
        with _local_copies(spec) as (train_path, val_path):
            val_data = _load_validation(spec, val_path)
            cached = _load_shard(spec, train_path) if spec.inmemory_cache_all else None
            train = _TrainBatches(spec, train_path, cached, module)
            val = None
            if val_data is not None and overrides(module, "validation_step"):
                val = _ValBatches(spec, val_data)
            trainer.fit(
                module,
                train_dataloaders=train,
                val_dataloaders=val,
                ckpt_path=ckpt_path,
                weights_only=True,
            )
    return history if hvd.rank() == 0 else None
