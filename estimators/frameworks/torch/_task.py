"""A torch worker's task: what it rebuilt from the spec, how it resumes and checkpoints.

:func:`rebuild` unpickles the model and rebuilds the optimizer from its class and param
groups on this replica's parameters (as Horovod's TorchEstimator does; under
``strategy='ring'`` wrapped in ``DistributedOptimizer`` with its compression);
:func:`restore` reads the run's checkpoint (rank 0 claims the run for this attempt and
loads a whole one into the model and optimizer; every rank gets the epochs done, the
history and the sharded folder to load, if any); :func:`prepare` applies the strategy
(``ringcore.torch.strategies``: rank 0's state on every rank, the DDP wrapper or the
FSDP2 shards and the rebuilt optimizer), loads a sharded checkpoint and builds the
lr_scheduler over the optimizer it steps; :func:`save_checkpoint` writes after each
epoch: rank 0's whole state under ring and ddp, every rank's shard under fsdp
(``_sharded``).
"""

from __future__ import annotations

import inspect
import io
import logging
from dataclasses import dataclass, field
from typing import Any

import cloudpickle
import torch

import ringcore.torch as hvd

from ..._callbacks import CallbackList
from ...data._spec import writer
from ._config import TorchConfig
from ._metrics import resolve_metrics
from ._progress import torch_progress_callbacks
from ._schedule import build_scheduler
from ._sharded import SHARDED_KEY, ShardFolders, shard_url, storage_options
from ._spec import TorchSpec
from ._tensors import on_cpu

__all__ = ["Resume", "Task", "prepare", "rebuild", "restore", "save_checkpoint", "worker_device"]

log = logging.getLogger("ringtrain.estimators")


@dataclass
class Task:
    """What this worker rebuilt from the spec."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[Any]  # per label column
    metrics: list[tuple[str, Any]]
    callbacks: CallbackList
    device: torch.device
    config: TorchConfig
    weights: list[float]  # per label column, loss_weights
    scheduler: Any = None  # the lr_scheduler, on this worker's optimizer
    minibatch_fn: Any = None  # Horovod's train_minibatch_fn
    scaler: Any = None  # precision='16': a torch.amp.GradScaler
    last_lr: float | None = None  # the learning rate of the last optimizer step
    best: dict[str, Any] | None = None  # rank 0: {"epoch", "model"} of the best monitor
    run: Any = (
        None  # the strategy's Prepared: run.model is task.model, run.optimizer task.optimizer
    )
    shards: ShardFolders | None = None  # strategy='fsdp': this writer's sharded folders
    last_batch: Any = None  # the last training batch (fsdp pads validation with it)


@dataclass
class Resume:
    """What every rank gets of the run's checkpoint."""

    epoch: int = 0  # epochs done
    history: list[dict[str, Any]] = field(default_factory=list)
    scheduler: dict[str, Any] | None = None  # rank 0's; broadcast when a scheduler runs
    sharded: str | None = None  # the sharded folder to load (its name under sharded/)


def worker_device(use_gpu: bool) -> torch.device:
    """The device this worker trains on. On a GPU, the one ``init()`` pinned (the one
    Spark assigned to the task, else the local rank's): ringcore's rule, and
    ``torch.cuda.set_device`` on it."""
    if use_gpu and torch.cuda.is_available():
        from ringcore.launch import pin_gpu

        return pin_gpu(hvd.local_rank(), hvd.local_size())
    return torch.device("cpu")


def _torch_optimizer(spec: TorchSpec, model: torch.nn.Module, optimizer_cls: type) -> Any:
    """The driver's optimizer rebuilt on this replica's parameters (as Horovod does)."""
    params = list(model.parameters())
    groups = spec.optimizer_state["param_groups"]
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in groups]
    accepted = inspect.signature(optimizer_cls).parameters
    required = {k: v for k, v in hyper[0].items() if k in accepted}  # e.g. an lr without default
    return optimizer_cls(
        [
            {"params": [params[i] for i in group], **h}
            for group, h in zip(spec.optimizer_groups, hyper, strict=True)
        ],
        **required,
    )


def _per_label(values: list[Any], count: int) -> list[Any]:
    return list(values) * count if len(values) == 1 else list(values)


def rebuild(spec: TorchSpec) -> Task:
    """This worker's :class:`Task` from the spec (see the module docstring)."""
    model, optimizer_cls, loss, metrics, callbacks = cloudpickle.loads(spec.user_objects)
    makers, scheduler, minibatch_fn = (
        cloudpickle.loads(spec.loop_objects) if spec.loop_objects else (None, None, None)
    )
    device = worker_device(spec.use_gpu)
    model.to(device)
    config = spec.config
    optimizer = _torch_optimizer(spec, model, optimizer_cls)
    if config.strategy == "ring":  # Horovod's optimizer, with its gradient compression
        optimizer = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=model.named_parameters(),
            compression=getattr(hvd.Compression, config.gradient_compression),
            backward_passes_per_step=spec.backward_passes_per_step,
        )
    optimizer.load_state_dict(spec.optimizer_state)  # the driver's hyper-parameters
    count = len(spec.label_cols)
    losses = [make() for make in makers] if makers else [loss]
    return Task(
        model,
        optimizer,
        _per_label(losses, count),
        resolve_metrics(metrics),
        CallbackList([*callbacks, *torch_progress_callbacks(spec, hvd.rank())]),
        device,
        config,
        _per_label(config.loss_weights or [1.0], count),
        scheduler=scheduler,  # its payload: built over the prepared optimizer (prepare)
        minibatch_fn=minibatch_fn,
        scaler=torch.amp.GradScaler(device.type) if config.precision == "16" else None,
    )


def _load_whole(task: Task, checkpoint: dict[str, Any]) -> bool:
    """Rank 0: a whole checkpoint (ring's, ddp's) into the unprepared model and optimizer,
    which the strategy spreads; False (nothing loaded) where its sharded folder is the
    better source: under fsdp (whose optimizer is rebuilt fresh), or when it holds no
    optimizer state (a finished fsdp run's)."""
    sharded = checkpoint.get(SHARDED_KEY) is not None
    if "model" not in checkpoint or (sharded and (_sharded(task) or "optimizer" not in checkpoint)):
        return False
    task.model.load_state_dict(checkpoint["model"])
    if "optimizer" in checkpoint and not _sharded(task):  # fsdp rebuilds its optimizer
        task.optimizer.load_state_dict(checkpoint["optimizer"])
    return True


def restore(task: Task, spec: TorchSpec) -> Resume:
    """Rank 0 claims the run and reads its checkpoint: a whole one is loaded into the
    model and optimizer here (before :func:`prepare`), a sharded one is named for
    :func:`prepare` to load on every rank. Every rank gets the :class:`Resume`."""
    resume = Resume()
    if hvd.rank() == 0:  # this attempt writes the run's checkpoints from now on
        spec.store.claim_run(spec.run_id, writer(spec))
    path = spec.store.find_checkpoint(spec.run_id) if hvd.rank() == 0 else None
    if path is not None:
        checkpoint = torch.load(
            io.BytesIO(spec.store.read_bytes(path)), weights_only=True, map_location=task.device
        )
        resume.sharded = None if _load_whole(task, checkpoint) else checkpoint.get(SHARDED_KEY)
        task.best = checkpoint.get("best")
        resume.epoch, resume.history = int(checkpoint["epoch"]), list(checkpoint["history"])
        resume.scheduler = checkpoint.get("scheduler")
    shared = hvd.broadcast_object(
        (resume.epoch, resume.history, resume.sharded), root_rank=0, name="ringtrain.resume"
    )
    resume.epoch, resume.history, resume.sharded = shared
    return resume


def _sharded(task: Task) -> bool:
    from ringcore.torch.strategies import get_strategy

    return get_strategy(task.config.strategy).sharded


def prepare(task: Task, spec: TorchSpec, resume: Resume) -> None:
    """Apply the fit's strategy (every rank: a collective), load a sharded checkpoint,
    build the lr_scheduler over the optimizer that steps and resume its state."""
    from ringcore.torch.strategies import get_strategy

    config = task.config
    run = get_strategy(config.strategy).prepare(
        task.model, task.optimizer, config=config.fsdp_config,
        backward_passes_per_step=spec.backward_passes_per_step,
    )  # fmt: skip
    task.run, task.model, task.optimizer = run, run.model, run.optimizer
    if run.sharded:
        task.shards = ShardFolders(spec.store, spec.run_id, writer(spec))
    if resume.sharded is not None:
        run.load_sharded(
            shard_url(spec.store, spec.run_id, resume.sharded), storage_options(spec.store)
        )
        if task.shards is not None:
            task.shards.resumed_from(resume.sharded)
    elif resume.epoch > 0 and run.sharded:
        log.warning(
            "run %r resumes a whole (ring or ddp) checkpoint under strategy='fsdp': its model "
            "is loaded, its optimizer state is not (the optimizer starts afresh)",
            spec.run_id,
        )
    task.scheduler = build_scheduler(task.scheduler, task.optimizer)
    if task.scheduler is not None and resume.epoch > 0:
        # every rank replays the schedule to the epoch reached (schedulers keep no tensors)
        state = hvd.broadcast_object(
            resume.scheduler, root_rank=0, name="ringtrain.resume.scheduler"
        )
        if state is not None:
            task.scheduler.load_state_dict(state)


def _whole_state(task: Task, epoch: int, history: list[dict[str, Any]]) -> dict[str, Any]:
    state: dict[str, Any] = {"epoch": epoch + 1, "history": history}
    if task.scheduler is not None:
        state["scheduler"] = task.scheduler.state_dict()
    if task.best is not None:
        state["best"] = task.best
    return state


def save_checkpoint(
    task: Task, spec: TorchSpec, epoch: int, history: list[dict[str, Any]], final: bool
) -> None:
    """Every rank, after each epoch. Ring and ddp: rank 0 writes the whole state with
    :meth:`Store.write_checkpoint` (whole or not at all, the previous one kept, refused
    if a newer attempt claimed the run), then the history. fsdp: every rank writes its
    shard first, then rank 0 the pointer (``_sharded``); ``final``: the whole model is
    gathered into it."""
    run = task.run
    state = _whole_state(task, epoch, history)
    if task.shards is not None:
        name = task.shards.name(epoch + 1)
        run.save_sharded(shard_url(spec.store, spec.run_id, name), storage_options(spec.store))
        full = run.full_state_dict() if final else None  # a collective: every rank
        state[SHARDED_KEY] = name
        if full is not None:
            state["model"] = full
    elif hvd.rank() == 0:  # CPU copies: the driver (maybe without a GPU) loads this checkpoint
        state["model"] = on_cpu(run.module.state_dict())
        state["optimizer"] = on_cpu(task.optimizer.state_dict())
    if hvd.rank() != 0:
        return
    spec.store.write_checkpoint(spec.run_id, writer(spec), lambda f: torch.save(state, f))
    spec.store.write_json(spec.store.get_history_path(spec.run_id), history)
    if task.shards is not None:
        task.shards.committed(state[SHARDED_KEY])
