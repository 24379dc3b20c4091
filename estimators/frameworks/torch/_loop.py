"""The torch training loop every worker runs: ``train(spec)``, in small named steps.

1. ``ringcore.init()``; rebuild the model, the optimizer (in ``DistributedOptimizer``
   under ``strategy='ring'``), the losses and the callbacks from the spec
   (``_task.rebuild``).
2. Resume from the run's checkpoint when there is one (rank 0 reads it), then apply
   the strategy (``_task.prepare``: rank 0's state on every rank; the DDP wrapper or
   the FSDP2 shards; a sharded checkpoint loaded on every rank).
3. Each epoch: ``steps_per_epoch`` steps on this rank's shard (the same count on
   every rank, ``_step``; the passes that do not step run under ``no_sync``), then
   validation on the whole validation shard (under fsdp, whose forward is a
   collective, a rank with fewer validation batches runs uncounted forwards until the
   others are done); sums and row counts are allreduced once, so the metrics are
   averages over every row.
4. After every epoch the checkpoint and the history go to the Store (``_task``: rank
   0's whole state, or every rank's shard under fsdp); rank 0 returns the history, the
   other ranks None.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

import ringcore.torch as hvd

from ...data._batches import (
    epoch_seed,
    load_shard,
    load_validation,
    training_batches,
    val_batches,
)
from ...data._readers import ValidationShard, data_paths
from ._config import is_plateau
from ._progress import abort_progress
from ._schedule import best_and_wait
from ._spec import TorchSpec
from ._step import batch_totals, forward, minibatch_totals, optimizer_step, step_totals, width
from ._task import Task, prepare, rebuild, restore, save_checkpoint

__all__ = ["train"]


def train(spec: TorchSpec) -> list[dict[str, Any]] | None:
    """Train on this rank's shard; rank 0 returns the history (one dict per epoch)."""
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    task = rebuild(spec)
    resume = restore(task, spec)
    prepare(task, spec, resume)
    start_epoch, history = resume.epoch, resume.history
    rank, size = hvd.rank(), hvd.size()
    with data_paths(spec.store, spec.train_path, spec.val_path) as (train_path, val_path):
        val_data = load_validation(spec, val_path, rank, size)
        cached = load_shard(spec, train_path, rank, size) if spec.inmemory_cache_all else None
        _run_epochs(task, spec, train_path, cached, val_data, start_epoch, history)
    return history if rank == 0 else None


def _train_epoch(task: Task, spec: TorchSpec, batches: Iterator[dict[str, Any]]) -> np.ndarray:
    task.model.train()
    totals = torch.zeros(width(task, spec.label_cols), dtype=torch.float64, device=task.device)
    every, last = spec.backward_passes_per_step, spec.steps_per_epoch
    task.optimizer.zero_grad()
    for step, batch in enumerate(batches):
        if task.minibatch_fn is not None:
            loss, row = minibatch_totals(task, spec, batch, step)
            if step + 1 == last:  # as Horovod's loop: the last step after the fn
                optimizer_step(task)
        else:
            stepping = (step + 1) % every == 0 or step + 1 == last
            with contextlib.nullcontext() if stepping else task.run.no_sync():
                loss, row = step_totals(task, spec, batch)
                (task.scaler.scale(loss) if task.scaler is not None else loss).backward()
            if stepping:
                optimizer_step(task)
        task.last_batch = batch
        totals += row
        if task.callbacks:
            loss_sum, rows = row[:2].tolist()  # a host sync, only when callbacks want it
            task.callbacks.call("on_batch_end", step, {"loss": loss_sum / rows, "rows": rows})
    return totals.cpu().numpy()


def _evaluate(task: Task, spec: TorchSpec, data: ValidationShard | None) -> np.ndarray:
    totals = np.zeros(width(task, spec.label_cols))
    if data is None:
        return totals
    module = task.run.module  # unwrapped: a DDP wrapper's forward would sync buffers
    module.eval()
    with torch.no_grad():
        summed = torch.zeros(len(totals), dtype=torch.float64, device=task.device)
        batches = val_batches(spec, data)
        while True:
            batch = next(batches, None)
            if task.run.sharded and not _more(batch is not None, task.device):
                break
            if batch is None and not task.run.sharded:
                break
            if batch is None:  # uncounted: another rank still validates
                forward(task, spec, task.last_batch, module)
                continue
            outputs, targets, loss = forward(task, spec, batch, module)
            summed += batch_totals(task, outputs, targets, loss)
    return summed.cpu().numpy()


def _more(mine: bool, device: torch.device) -> bool:
    """Whether any rank has another validation batch (fsdp: every rank runs as many
    forwards as the rank with the most, each one a collective)."""
    import torch.distributed as dist

    flag = torch.tensor([float(mine)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _metric_names(task: Task, spec: TorchSpec) -> list[str]:
    many = len(spec.label_cols) > 1
    return [
        f"{label}_{name}" if many else name for name, _ in task.metrics for label in spec.label_cols
    ]


def _means(totals: np.ndarray) -> np.ndarray:
    """``[loss, metric, ...]`` per row from ``[loss * rows, rows, metric * rows, ...]``."""
    return np.delete(totals, 1) / max(totals[1], 1.0)


def _epoch_entry(
    task: Task, spec: TorchSpec, epoch: int, train: np.ndarray, val: np.ndarray
) -> dict[str, Any]:
    """Average the epoch's sums over every rank (one allreduce) into a history entry."""
    summed = hvd.allreduce(
        torch.from_numpy(np.concatenate([train, val])), op=hvd.Sum, name="ringtrain.epoch_metrics"
    ).numpy()
    train, val = summed[: len(train)], summed[len(train) :]
    names = ["loss", *_metric_names(task, spec)]
    entry: dict[str, Any] = {"epoch": epoch + 1}
    entry.update({f"train_{n}": float(v) for n, v in zip(names, _means(train), strict=True)})
    if spec.val_path is not None and val[1] > 0:
        entry.update({f"val_{n}": float(v) for n, v in zip(names, _means(val), strict=True)})
    return entry


def _after_epoch(task: Task, entry: dict[str, Any], history: list[dict[str, Any]]) -> bool:
    """The epoch's scheduler step, the best weights (rank 0) and whether to stop early:
    decided from the history (the same on every rank: its metrics are allreduced), and
    rank 0's decision broadcast all the same, so every rank stops at one epoch."""
    config = task.config
    if task.scheduler is not None:
        entry["lr"] = task.last_lr
        if config.lr_scheduler_interval == "epoch":
            if is_plateau(task.scheduler):
                task.scheduler.step(entry[config.monitor])
            else:
                task.scheduler.step()
    best, wait = best_and_wait(
        history, config.monitor, config.monitor_mode, config.early_stopping_min_delta
    )
    if config.restore_best_weights and best == len(history) - 1:
        state = task.run.full_state_dict()  # fsdp: a collective (every rank decides alike)
        if hvd.rank() == 0:
            task.best = {
                "epoch": best + 1,
                "model": {k: v.detach().cpu().clone() for k, v in state.items()},
            }
    patience = config.early_stopping_patience
    stop = patience is not None and best is not None and wait >= patience
    stop = bool(hvd.broadcast_object(stop, root_rank=0, name="ringtrain.early_stop"))
    if stop:
        entry["stopped_early"] = True
    return stop


def _run_epochs(
    task: Task,
    spec: TorchSpec,
    train_path: str,
    cached: dict[str, np.ndarray] | None,
    val_data: ValidationShard | None,
    start_epoch: int,
    history: list[dict[str, Any]],
) -> None:
    rank, size = hvd.rank(), hvd.size()
    task.callbacks.call("set_context", task.model, task.optimizer, rank, size)
    task.callbacks.call("on_train_begin", {"start_epoch": start_epoch})
    try:
        for epoch in range(start_epoch, spec.epochs):
            started = time.monotonic()
            torch.manual_seed(epoch_seed(spec, epoch, rank))
            task.callbacks.call("on_epoch_begin", epoch, {})
            batches = training_batches(spec, train_path, cached, epoch, rank, size)
            try:
                train_totals = _train_epoch(task, spec, batches)
            finally:
                batches.close()  # stops the epoch's reader (petastorm's threads)
            entry = _epoch_entry(task, spec, epoch, train_totals, _evaluate(task, spec, val_data))
            entry["seconds"] = round(time.monotonic() - started, 3)
            history.append(entry)
            stop = _after_epoch(task, entry, history)
            save_checkpoint(task, spec, epoch, history, final=stop or epoch + 1 == spec.epochs)
            task.callbacks.call("on_epoch_end", epoch, dict(entry))
            if stop:
                break
    except BaseException:
        abort_progress(task.callbacks)  # rank 0's event files' temp folder goes now
        raise
    task.callbacks.call("on_train_end", {"history": list(history)})
