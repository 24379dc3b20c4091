"""A torch worker's task: what it rebuilt from the spec, how it resumes and checkpoints.

:func:`rebuild` unpickles the model, rebuilds the optimizer from its class and param
groups on this replica's parameters (as Horovod's TorchEstimator does) and wraps it in
``DistributedOptimizer``; :func:`restore` resumes the run's checkpoint (rank 0 claims
the run for this attempt and reads it, every rank gets the epochs done and the
history); :func:`save_checkpoint` is rank 0's write after each epoch.
"""

from __future__ import annotations

import inspect
import io
from dataclasses import dataclass
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
from ._spec import TorchSpec
from ._tensors import on_cpu

__all__ = ["Task", "rebuild", "restore", "save_checkpoint", "worker_device"]


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
    optimizer = hvd.DistributedOptimizer(
        _torch_optimizer(spec, model, optimizer_cls),
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
        scheduler=build_scheduler(scheduler, optimizer),
        minibatch_fn=minibatch_fn,
        scaler=torch.amp.GradScaler(device.type) if config.precision == "16" else None,
    )


def restore(task: Task, spec: TorchSpec) -> tuple[int, list[dict[str, Any]]]:
    """Load the run's checkpoint on rank 0 when there is one; every rank gets
    ``(epochs done, history)``. The caller broadcasts the state afterwards."""
    done: tuple[int, list[dict[str, Any]]] = (0, [])
    if hvd.rank() == 0:  # this attempt writes the run's checkpoints from now on
        spec.store.claim_run(spec.run_id, writer(spec))
    path = spec.store.find_checkpoint(spec.run_id) if hvd.rank() == 0 else None
    if path is not None:
        checkpoint = torch.load(
            io.BytesIO(spec.store.read_bytes(path)), weights_only=True, map_location=task.device
        )
        task.model.load_state_dict(checkpoint["model"])
        task.optimizer.load_state_dict(checkpoint["optimizer"])
        task.best = checkpoint.get("best")
        done = (int(checkpoint["epoch"]), list(checkpoint["history"]))
    done = hvd.broadcast_object(done, root_rank=0, name="ringtrain.resume")
    if task.scheduler is not None and done[0] > 0:
        # every rank replays the schedule to the epoch reached (schedulers keep no tensors)
        state = checkpoint.get("scheduler") if path is not None else None
        state = hvd.broadcast_object(state, root_rank=0, name="ringtrain.resume.scheduler")
        if state is not None:
            task.scheduler.load_state_dict(state)
    return done


def save_checkpoint(task: Task, spec: TorchSpec, epoch: int, history: list[dict[str, Any]]) -> None:
    """Rank 0, after each epoch: :meth:`Store.write_checkpoint` (whole or not at all, the
    previous one kept, refused if a newer attempt claimed the run), then the history."""
    state = {  # CPU copies: the driver (maybe without a GPU) loads this checkpoint
        "model": on_cpu(task.model.state_dict()),
        "optimizer": on_cpu(task.optimizer.state_dict()),
        "epoch": epoch + 1,
        "history": history,
    }
    if task.scheduler is not None:
        state["scheduler"] = task.scheduler.state_dict()
    if task.best is not None:
        state["best"] = task.best
    spec.store.write_checkpoint(spec.run_id, writer(spec), lambda f: torch.save(state, f))
    spec.store.write_json(spec.store.get_history_path(spec.run_id), history)
