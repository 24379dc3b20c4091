"""The Lightning worker: the user's LightningModule under a real ``lightning.Trainer``.

Every Spark task forms the ring (``ringcore.init()``), then fits the module with
``Trainer(strategy=RingStrategy, devices=1, max_epochs=epochs, ...)`` on its own shard
(``_strategy``: the ranks are the ring's, gradients averaged after every backward), or
with ``trainer_args={"strategy": "ddp"}`` under Lightning's own ``DDPStrategy`` on the
job's process group, ``devices`` the ranks on each host and ``num_nodes`` the hosts
(``_strategies``).
The batches come from the same Parquet readers as every framework's loop (per-rank
shards, ``steps_per_epoch`` steps on every rank, shuffled by ``(random_seed, epoch)``),
as dicts ``{column: tensor}``; so ``self.trainer``, ``self.current_epoch``,
``self.global_step``, ``self.log`` (and ``sync_dist``), callbacks, loggers, profilers,
precision, gradient clipping, accumulation and manual optimization with several
optimizers are Lightning's own.

ringtrain adds its callbacks (``_callbacks``): the store checkpoint after each epoch
(rank 0 claims the run as this fit's stage attempt first, as the torch loop does, and a
write after a newer attempt claimed it raises ``StaleWriterError``, writing nothing),
rank 0's progress and, with ``terminate_on_nan``, the NaN stop. A resumed ``run_id``
hands Lightning's own checkpoint back to ``trainer.fit(ckpt_path=...)``, so the Trainer
goes on at the next epoch with ``global_step``, optimizer and scheduler states where
they were.
"""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import numpy as np
import torch

import ringcore.torch as hvd

from ...data._batches import (
    columns_of,
    epoch_seed,
    load_shard,
    load_validation,
    training_batches,
    val_batches,
)
from ...data._readers import ValidationShard, data_paths
from ...data._spec import DataSpec, data_spec_fields, writer
from ..torch._task import worker_device
from ..torch._tensors import tensor
from ._callbacks import nan_callback, on_rank_0, progress_callbacks, store_callback
from ._config import LightningConfig
from ._log import LogRecorder, mirror_log, overrides
from ._strategies import check_layout, lightning_strategy
from ._strategy import lightning_package, ring_strategy
from ._trainer_args import check_trainer_args

__all__ = ["LightningSpec", "lightning_spec", "train_lightning"]


@dataclass(frozen=True, kw_only=True)
class LightningSpec(DataSpec):
    """Everything a Lightning worker needs, as picklable data: the module, its
    callbacks and the Trainer's params (Horovod LightningEstimator's)."""

    user_objects: bytes  # cloudpickle of (the LightningModule, its Lightning callbacks)
    use_gpu: bool = False  # the Trainer on cuda:<local rank>
    inmemory_cache_all: bool = False  # read the shard once, serve every epoch from memory
    trainer_args: dict[str, Any] = field(default_factory=dict)
    logger: Any = None  # a lightning logger (or a list of them); None / False: none
    log_every_n_steps: int = 50
    terminate_on_nan: bool = False
    profiler: Any = None


def lightning_spec(cfg: Any, data: Any) -> LightningSpec:
    """The :class:`LightningSpec` of a fit of ``cfg`` on ``data`` (the Trainer's params
    from ``cfg.framework_config``, a :class:`LightningConfig`; defaults without one)."""
    config = getattr(cfg, "framework_config", None) or LightningConfig()
    return LightningSpec(
        user_objects=cloudpickle.dumps((cfg.model, cfg.callbacks)),
        **data_spec_fields(cfg, data),
        use_gpu=cfg.use_gpu,
        inmemory_cache_all=cfg.inmemory_cache_all,
        trainer_args=dict(config.trainer_args or {}),
        logger=config.logger,
        log_every_n_steps=config.log_every_n_steps,
        terminate_on_nan=config.terminate_on_nan,
        profiler=config.profiler,
    )


# --- batches -----------------------------------------------------------------------------


def _batch(spec: DataSpec, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """``{column: tensor}``: features float32, labels and weights as stored."""
    tensors = {c: tensor(batch[c]) for c in columns_of(spec)}
    for c in spec.feature_cols:
        tensors[c] = tensors[c].to(torch.float32)
    return tensors


class _TrainBatches:
    """The epoch's ``steps_per_epoch`` batches of this rank's shard (an iterable the
    Trainer takes as its train dataloader). The epoch is the Trainer's, so a resumed fit
    reads what an uninterrupted one would."""

    def __init__(self, spec: LightningSpec, train_path: str, cached: Any, module: Any) -> None:
        self.spec, self.train_path, self.cached, self.module = spec, train_path, cached, module

    def __len__(self) -> int:
        return self.spec.steps_per_epoch

    def __iter__(self):
        spec, rank = self.spec, hvd.rank()
        epoch = int(self.module.trainer.current_epoch)
        torch.manual_seed(epoch_seed(spec, epoch, rank))
        batches = training_batches(spec, self.train_path, self.cached, epoch, rank, hvd.size())
        try:
            for batch in batches:
                yield _batch(spec, batch)
        finally:
            batches.close()  # stops the epoch's reader (petastorm's threads)


class _ValBatches:
    """This rank's validation shard (streamed from the store) in ``val_batch_size`` batches."""

    def __init__(self, spec: LightningSpec, data: ValidationShard) -> None:
        self.spec, self.data = spec, data

    def __len__(self) -> int:
        return len(self.data)  # val_steps at most

    def __iter__(self):
        for batch in val_batches(self.spec, self.data):
            yield _batch(self.spec, batch)


# --- resuming ----------------------------------------------------------------------------


def _read_resume_state(spec: LightningSpec) -> tuple[int, list[dict[str, Any]], bytes | None]:
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


def _resume_state(spec: LightningSpec) -> tuple[int, list[dict[str, Any]], bytes | None]:
    """What rank 0 read (:func:`_read_resume_state`), on every rank."""
    return on_rank_0(lambda: _read_resume_state(spec), "ringtrain.lightning.resume")


# --- the Trainer -------------------------------------------------------------------------


def _strategy(pl: Any, spec: LightningSpec, device: torch.device) -> tuple[Any, int, int]:
    """``(strategy, devices, num_nodes)``: ringtrain's RingStrategy on one device, or
    under ``trainer_args["strategy"]`` Lightning's DDPStrategy on the ranks of each
    host (``_strategies``)."""
    chosen = spec.trainer_args.get("strategy")
    if chosen is None:
        return ring_strategy(pl, device), 1, 1
    check_layout()
    return lightning_strategy(pl, chosen, device)


def _trainer(pl: Any, spec: LightningSpec, device: torch.device, callbacks: list) -> Any:
    check_trainer_args(spec.trainer_args, spec.backward_passes_per_step)
    strategy, devices, num_nodes = _strategy(pl, spec, device)
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
        **{k: v for k, v in spec.trainer_args.items() if k != "strategy"},
    }
    return pl.Trainer(
        strategy=strategy,
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=devices,
        num_nodes=num_nodes,
        max_epochs=spec.epochs,
        enable_checkpointing=True,  # the store callback is a Checkpoint
        callbacks=callbacks,
        **kwargs,
    )


def train_lightning(spec: LightningSpec) -> list[dict[str, Any]] | None:
    """Fit the LightningModule on this rank's shard; rank 0 returns the history."""
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    module, user_callbacks = cloudpickle.loads(spec.user_objects)
    pl = lightning_package(module)
    start, history, resume = _resume_state(spec)
    if start >= spec.epochs:
        return history if hvd.rank() == 0 else None
    recorder = LogRecorder()
    mirror_log(module, recorder)
    callbacks = [*user_callbacks, store_callback(pl, spec, recorder, history)]
    callbacks += progress_callbacks(pl, spec, hvd.rank(), history)  # rank 0: progress, TB
    if spec.terminate_on_nan:
        callbacks.append(nan_callback(pl))
    device = worker_device(spec.use_gpu)
    with tempfile.TemporaryDirectory(prefix="ringtrain-lightning-") as work:
        ckpt_path = None
        if resume is not None:
            ckpt_path = os.path.join(work, "resume.ckpt")
            with open(ckpt_path, "wb") as f:
                f.write(resume)
        trainer = _trainer(pl, spec, device, callbacks)
        rank, size = hvd.rank(), hvd.size()
        with data_paths(spec.store, spec.train_path, spec.val_path) as (train_path, val_path):
            val_data = load_validation(spec, val_path, rank, size)
            cached = load_shard(spec, train_path, rank, size) if spec.inmemory_cache_all else None
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
