"""The torch training loop every worker runs: ``train(spec)``, in small named steps.

1. ``ringcore.init()``; rebuild the model from its pickled bytes and the optimizer
   from its class and param groups on this replica's parameters (as Horovod's
   TorchEstimator does); wrap it in ``DistributedOptimizer``.
2. Resume from the run's checkpoint when there is one (rank 0 reads it), then
   broadcast parameters and optimizer state from rank 0.
3. Each epoch: ``steps_per_epoch`` steps on this rank's shard (the same count on
   every rank), then validation on the whole validation shard; sums and row
   counts are allreduced once, so the metrics are averages over every row.
4. Rank 0 writes the checkpoint and the history to the Store after every epoch and
   returns the history; the other ranks return None.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import os
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import cloudpickle
import numpy as np
import torch

import ringcore.torch as hvd

from ._callbacks import CallbackList
from ._knobs import TrainingKnobs, best_and_wait, build_scheduler, is_plateau
from ._lightning import LogRecorder
from ._metrics import resolve_metrics
from ._progress import abort_progress, torch_progress_callbacks
from ._readers import (
    ValidationShard,
    data_paths,
    open_training,
    read_whole_shard,
    validation_shard,
)
from ._spec import DataSpec, writer

__all__ = ["TrainSpec", "as_outputs", "to_device", "to_inputs", "train"]


@dataclass(frozen=True, kw_only=True)
class TrainSpec(DataSpec):
    """Everything a torch / Lightning worker needs, as picklable data (no SparkSession)."""

    user_objects: bytes  # cloudpickle of (model, optimizer class, loss, metrics)
    optimizer_groups: list[list[int]]  # per param group: indices into model.parameters()
    optimizer_state: dict[str, Any]  # the driver optimizer's state_dict()
    lightning: bool = False  # a LightningModule (trained by _train_lightning, not here)
    use_gpu: bool = False  # model and batches on cuda:<local rank>
    inmemory_cache_all: bool = False  # read the shard once, serve every epoch from memory
    knobs: TrainingKnobs = field(default_factory=TrainingKnobs)  # callables: in loop_objects
    loop_objects: bytes = b""  # cloudpickle of (loss_constructors, lr_scheduler, minibatch fn)


@dataclass
class _Task:
    """What this worker rebuilt from the spec."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    losses: list[Any]  # per label column
    metrics: list[tuple[str, Any]]
    callbacks: CallbackList
    device: torch.device
    knobs: TrainingKnobs
    weights: list[float]  # per label column, loss_weights
    scheduler: Any = None  # the lr_scheduler, on this worker's optimizer
    minibatch_fn: Any = None  # Horovod's train_minibatch_fn
    scaler: Any = None  # precision='16': a torch.amp.GradScaler
    last_lr: float | None = None  # the learning rate of the last optimizer step
    best: dict[str, Any] | None = None  # rank 0: {"epoch", "model"} of the best monitor


# --- tensors ---------------------------------------------------------------------------


def _tensor(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def to_inputs(batch: dict[str, np.ndarray], feature_cols: list[str]) -> list[torch.Tensor]:
    """Model inputs: float32 tensors; a scalar column becomes shape (rows, 1)."""
    inputs = []
    for col in feature_cols:
        tensor = _tensor(batch[col]).to(torch.float32)
        inputs.append(tensor.view(-1, 1) if tensor.dim() == 1 else tensor)
    return inputs


def as_outputs(result: Any, count: int) -> list[torch.Tensor]:
    """The model's result as one tensor per label column."""
    if isinstance(result, torch.Tensor):
        result = [result]
    result = list(result)
    if len(result) != count:
        raise ValueError(
            f"the model returned {len(result)} output(s) but label_cols names {count}; "
            "return one tensor per label column"
        )
    return result


def _as_target(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Meet the loss halfway: a (rows,) label against a (rows, 1) output becomes (rows, 1)
    of the output's dtype; a float (rows,) label against (rows, classes) logits
    becomes class indices (Spark ML labels are doubles)."""
    if label.dim() == 1 and output.dim() == 2:
        if output.shape[1] == 1:
            return label.view(-1, 1).to(output.dtype)
        if label.is_floating_point():
            return label.to(torch.long)
    return label


# --- set-up ---------------------------------------------------------------------------------


def _device(spec: TrainSpec) -> torch.device:
    if spec.use_gpu and torch.cuda.is_available():
        # The GPU init() pinned (the one Spark assigned to the task, else the local
        # rank's): the same rule as ringcore's, and torch.cuda.set_device on it.
        from ringcore.launch import pin_gpu

        return pin_gpu(hvd.local_rank(), hvd.local_size())
    return torch.device("cpu")


def _torch_optimizer(spec: TrainSpec, model: torch.nn.Module, optimizer_cls: type) -> Any:
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


def _rebuild(spec: TrainSpec) -> _Task:
    if spec.lightning:
        raise ValueError("a LightningModule trains under _train_lightning.train_lightning")
    model, optimizer_cls, loss, metrics, callbacks = cloudpickle.loads(spec.user_objects)
    makers, scheduler, minibatch_fn = (
        cloudpickle.loads(spec.loop_objects) if spec.loop_objects else (None, None, None)
    )
    device = _device(spec)
    model.to(device)
    optimizer = hvd.DistributedOptimizer(
        _torch_optimizer(spec, model, optimizer_cls),
        named_parameters=model.named_parameters(),
        compression=getattr(hvd.Compression, spec.knobs.gradient_compression),
        backward_passes_per_step=spec.backward_passes_per_step,
    )
    optimizer.load_state_dict(spec.optimizer_state)  # the driver's hyper-parameters
    count, knobs = len(spec.label_cols), spec.knobs
    losses = [make() for make in makers] if makers else [loss]
    return _Task(
        model,
        optimizer,
        _per_label(losses, count),
        resolve_metrics(metrics),
        CallbackList([*callbacks, *torch_progress_callbacks(spec, hvd.rank())]),
        device,
        knobs,
        _per_label(knobs.loss_weights or [1.0], count),
        scheduler=build_scheduler(scheduler, optimizer),
        minibatch_fn=minibatch_fn,
        scaler=torch.amp.GradScaler(device.type) if knobs.precision == "16" else None,
    )


def _restore(task: _Task, spec: TrainSpec) -> tuple[int, list[dict[str, Any]]]:
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


class _ColumnSpec(Protocol):  # TrainSpec and _train_keras.KerasTrainSpec (frozen: read-only)
    @property
    def feature_cols(self) -> list[str]: ...
    @property
    def label_cols(self) -> list[str]: ...
    @property
    def sample_weight_col(self) -> str | None: ...


def _columns(spec: _ColumnSpec) -> list[str]:
    """The columns a worker reads: features, labels, then the weight column if any."""
    weight = [spec.sample_weight_col] if spec.sample_weight_col is not None else []
    return spec.feature_cols + spec.label_cols + weight


def _load_validation(spec: TrainSpec, path: str | None) -> ValidationShard | None:
    """This rank's validation shard, streamed batch by batch each time it is iterated."""
    if path is None:
        return None
    return validation_shard(spec, path, rank=hvd.rank(), size=hvd.size(), columns=_columns(spec))


def _load_shard(spec: TrainSpec, path: str) -> dict[str, np.ndarray]:
    rank, size = hvd.rank(), hvd.size()
    return read_whole_shard(
        spec.store,
        path,
        rank=rank,
        size=size,
        columns=_columns(spec),
        reader=spec.reader,
        workers_count=spec.reader_workers,
        pool_type=spec.reader_pool,
    )


def _transformed(spec: TrainSpec, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return batch if spec.transformation_fn is None else spec.transformation_fn(batch)


@contextlib.contextmanager
def _local_copies(spec: TrainSpec) -> Iterator[tuple[str, str | None]]:
    """The paths of the training and validation data: the store's own, read in place
    (a remote store too), or local copies with ``local_copy=True`` (see _readers)."""
    with data_paths(spec.store, spec.train_path, spec.val_path) as paths:
        yield paths


# --- one epoch ------------------------------------------------------------------------------


def _batch_totals(
    task: _Task,
    spec: TrainSpec,
    outputs: list[torch.Tensor],
    targets: list[torch.Tensor],
    loss: torch.Tensor,
) -> torch.Tensor:
    """``[loss * rows, rows, metric * rows, ...]`` of one batch, a float64 tensor on the
    loss's device: no host sync per step (the epoch's sums are read once, at its end)."""
    rows = len(targets[0])
    with torch.no_grad():
        values = [_scalar(loss) * rows, loss.new_full((), rows, dtype=torch.float64)]
        for _, fn in task.metrics:
            values.extend(
                _scalar(fn(o, t), loss.device) * rows for o, t in zip(outputs, targets, strict=True)
            )
    return torch.stack(values)


def _scalar(value: Any, device: torch.device | None = None) -> torch.Tensor:
    """A one-element loss or metric value as a 0-d float64 tensor (on its own device)."""
    tensor = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value)
    if device is not None and tensor.device != device:
        tensor = tensor.to(device)
    return tensor.to(torch.float64).reshape(())


def _per_row_loss(loss_fn: Any, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The loss of every row: torch losses are called with ``reduction='none'``; other
    callables must return one value per row themselves."""
    reduction = getattr(loss_fn, "reduction", None)
    if reduction is not None:
        loss_fn.reduction = "none"
    try:
        losses = loss_fn(output, target)
    finally:
        if reduction is not None:
            loss_fn.reduction = reduction
    if losses.dim() == 0:
        raise ValueError(
            "sample_weight_col is set but the loss returned one number for the batch; pass a "
            "torch loss (it is called with reduction='none') or a loss returning one value per row."
        )
    return losses.reshape(len(output), -1).mean(dim=1)


def _loss(loss_fn: Any, output: torch.Tensor, target: torch.Tensor, weight: Any) -> torch.Tensor:
    """The batch's loss; with sample weights, ``mean(weight * per-row loss)`` (as Keras)."""
    if weight is None:
        return loss_fn(output, target)
    return (_per_row_loss(loss_fn, output, target) * weight).mean()


def _total_loss(task: _Task, outputs: list, targets: list, weight: Any) -> torch.Tensor:
    """``sum(loss_weights[i] * loss_i)`` over the label columns."""
    parts = zip(task.losses, task.weights, outputs, targets, strict=True)
    total: torch.Tensor = sum(w * _loss(fn, o, t, weight) for fn, w, o, t in parts)  # type: ignore[assignment]
    return total


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU through pinned memory without blocking the host
    (torch's caching host allocator keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _batch_tensors(task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray]):
    """``(inputs, labels, sample weights or None)`` of a batch, on the task's device."""
    inputs = [to_device(t, task.device) for t in to_inputs(batch, spec.feature_cols)]
    labels = [to_device(_tensor(batch[c]), task.device) for c in spec.label_cols]
    weight = None
    if spec.sample_weight_col is not None:
        weight = _tensor(batch[spec.sample_weight_col]).to(torch.float32).reshape(-1)
        weight = to_device(weight, task.device)
    return inputs, labels, weight


def _forward(task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray]):
    inputs, labels, weight = _batch_tensors(task, spec, batch)
    with _autocast(task):
        outputs = as_outputs(task.model(*inputs), len(spec.label_cols))
        targets = [_as_target(o, label) for o, label in zip(outputs, labels, strict=True)]
        loss = _total_loss(task, outputs, targets, weight)
    return outputs, targets, loss


def _autocast(task: _Task) -> Any:
    """``precision``: the forward and the loss under ``torch.autocast`` (bf16 / fp16)."""
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(task.knobs.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=task.device.type, dtype=dtype)


def _minibatch_totals(task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray], step: int):
    """Horovod's ``train_minibatch_fn`` on one batch: it runs the forward, the backward
    and the optimizer steps; returns ``(loss, its totals row)``."""
    inputs, labels, weight = _batch_tensors(task, spec, batch)

    def transform_outputs(outputs: Any, labels: list) -> tuple[list, list]:
        outputs = as_outputs(outputs, len(spec.label_cols))
        return outputs, [_as_target(o, t) for o, t in zip(outputs, labels, strict=True)]

    def loss_fn(outputs: list, labels: list, sample_weights: Any) -> torch.Tensor:
        return _total_loss(task, outputs, labels, sample_weights)

    outputs, loss = task.minibatch_fn(
        task.model, task.optimizer, transform_outputs, loss_fn, inputs, labels, weight,
        spec.backward_passes_per_step, step,
    )  # fmt: skip
    outputs, targets = transform_outputs(outputs, labels)
    return loss, _batch_totals(task, spec, outputs, targets, loss)


def _step_totals(task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray], step: int):
    """Forward one training batch: ``(loss, its totals row)``."""
    outputs, targets, loss = _forward(task, spec, batch)
    return loss, _batch_totals(task, spec, outputs, targets, loss)


def _clip(task: _Task) -> None:
    clip = task.knobs.gradient_clip_val
    if clip is None:
        return
    params = [p for p in task.model.parameters() if p.grad is not None]
    if task.knobs.gradient_clip_algorithm == "value":
        torch.nn.utils.clip_grad_value_(params, clip)
    else:
        torch.nn.utils.clip_grad_norm_(params, clip)


def _optimizer_step(task: _Task) -> None:
    """One optimizer step on the averaged gradients: with clipping, allreduce first
    (``synchronize``), clip, then step without reducing again; with a GradScaler,
    unscale before clipping. A per-step lr_scheduler steps after it."""
    opt, scaler = task.optimizer, task.scaler
    task.last_lr = float(opt.param_groups[0]["lr"])
    if task.knobs.gradient_clip_val is not None:
        opt.synchronize()  # type: ignore[attr-defined]  # ringcore's DistributedOptimizer
        if scaler is not None:
            scaler.unscale_(opt)
        _clip(task)
        with opt.skip_synchronize():  # type: ignore[attr-defined]
            scaler.step(opt) if scaler is not None else opt.step()
    elif scaler is not None:
        scaler.step(opt)
    else:
        opt.step()
    if scaler is not None:
        scaler.update()
    opt.zero_grad()
    if task.scheduler is not None and task.knobs.lr_scheduler_interval == "step":
        task.scheduler.step()


def _width(task: _Task, spec: TrainSpec) -> int:
    return 2 + len(task.metrics) * len(spec.label_cols)


def _train_epoch(task: _Task, spec: TrainSpec, batches: Any) -> np.ndarray:
    task.model.train()
    totals = torch.zeros(_width(task, spec), dtype=torch.float64, device=task.device)
    every = spec.backward_passes_per_step
    task.optimizer.zero_grad()
    for step in range(spec.steps_per_epoch):
        batch = next(batches, None)
        if batch is None:
            raise RuntimeError(
                f"the training reader of {spec.train_path} gave no batch at step {step}; "
                "this rank's shard is empty"
            )
        if task.minibatch_fn is not None:
            loss, row = _minibatch_totals(task, spec, _transformed(spec, batch), step)
            if step + 1 == spec.steps_per_epoch:  # as Horovod's loop: the last step after the fn
                _optimizer_step(task)
        else:
            loss, row = _step_totals(task, spec, _transformed(spec, batch), step)
            (task.scaler.scale(loss) if task.scaler is not None else loss).backward()
            if (step + 1) % every == 0 or step + 1 == spec.steps_per_epoch:
                _optimizer_step(task)
        totals += row
        if task.callbacks:
            loss_sum, rows = row[:2].tolist()  # a host sync, only when callbacks want it
            task.callbacks.call("on_batch_end", step, {"loss": loss_sum / rows, "rows": rows})
    return totals.cpu().numpy()


def _val_batches(spec: TrainSpec, data: ValidationShard) -> Iterator[dict[str, np.ndarray]]:
    for batch in data:  # streamed from the store: val_batch_size rows, val_steps at most
        yield _transformed(spec, batch)


def _evaluate(task: _Task, spec: TrainSpec, data: ValidationShard | None) -> np.ndarray:
    totals = np.zeros(_width(task, spec))
    if data is None:
        return totals
    task.model.eval()
    with torch.no_grad():
        summed = torch.zeros(len(totals), dtype=torch.float64, device=task.device)
        for batch in _val_batches(spec, data):
            outputs, targets, loss = _forward(task, spec, batch)
            summed += _batch_totals(task, spec, outputs, targets, loss)
    return summed.cpu().numpy()


def _metric_names(task: _Task, spec: TrainSpec) -> list[str]:
    many = len(spec.label_cols) > 1
    return [
        f"{label}_{name}" if many else name for name, _ in task.metrics for label in spec.label_cols
    ]


def _means(totals: np.ndarray) -> np.ndarray:
    """``[loss, metric, ...]`` per row from ``[loss * rows, rows, metric * rows, ...]``."""
    return np.delete(totals, 1) / max(totals[1], 1.0)


def _epoch_entry(
    task: _Task, spec: TrainSpec, epoch: int, train: np.ndarray, val: np.ndarray
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


def _logged_means(recorder: LogRecorder) -> dict[str, float]:
    """The epoch's ``self.log`` values, weighted means over every rank (a name logged on
    some ranks only counts where it was logged)."""
    local = recorder.take()
    names = sorted(set().union(*hvd.allgather_object(sorted(local), name="ringtrain.logged")))
    if not names:
        return {}
    sums = np.stack([local.get(n, np.zeros(2)) for n in names])
    sums = hvd.allreduce(torch.from_numpy(sums), op=hvd.Sum, name="ringtrain.logged_sums")
    return {n: float(s / max(w, 1e-12)) for n, (s, w) in zip(names, sums.tolist(), strict=True)}


def _on_cpu(value: Any) -> Any:
    """``value`` (a state_dict, nested dicts / lists) with every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_on_cpu(v) for v in value)
    return value


def _save_checkpoint(
    task: _Task, spec: TrainSpec, epoch: int, history: list[dict[str, Any]]
) -> None:
    """Rank 0, after each epoch: :meth:`Store.write_checkpoint` (whole or not at all, the
    previous one kept, refused if a newer attempt claimed the run), then the history."""
    state = {  # CPU copies: the driver (maybe without a GPU) loads this checkpoint
        "model": _on_cpu(task.model.state_dict()),
        "optimizer": _on_cpu(task.optimizer.state_dict()),
        "epoch": epoch + 1,
        "history": history,
    }
    if task.scheduler is not None:
        state["scheduler"] = task.scheduler.state_dict()
    if task.best is not None:
        state["best"] = task.best
    spec.store.write_checkpoint(spec.run_id, writer(spec), lambda f: torch.save(state, f))
    spec.store.write_json(spec.store.get_history_path(spec.run_id), history)


# --- the worker's function --------------------------------------------------------------------


def train(spec: TrainSpec) -> list[dict[str, Any]] | None:
    """Train on this rank's shard; rank 0 returns the history (one dict per epoch)."""
    hvd.init()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // hvd.local_size()))
    task = _rebuild(spec)
    start_epoch, history = _restore(task, spec)
    hvd.broadcast_parameters(task.model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(task.optimizer, root_rank=0)
    with _local_copies(spec) as (train_path, val_path):
        val_data = _load_validation(spec, val_path)
        cached = _load_shard(spec, train_path) if spec.inmemory_cache_all else None
        _run_epochs(task, spec, train_path, cached, val_data, start_epoch, history)
    return history if hvd.rank() == 0 else None


def _epoch_seed(spec: TrainSpec, epoch: int, extra: int = 0) -> int:
    """Shuffles and torch's RNG depend on (random_seed, epoch) only, so a resumed run
    draws what an uninterrupted one would."""
    return (spec.seed * 1_000_003 + epoch * 1009 + extra) % 2**31


def _memory_batches(
    spec: TrainSpec, data: dict[str, np.ndarray], epoch: int
) -> Generator[dict[str, Any], None, None]:
    """``inmemory_cache_all``: the epoch's batches out of the shard held in memory,
    in the order ``(random_seed, epoch)`` draws; the last partial batch dropped."""
    rows = len(data[spec.label_cols[0]])
    if rows == 0:
        return
    reps = -(-spec.batch_size // rows)  # a shard smaller than a batch: repeat it
    data = {k: np.concatenate([v] * reps) for k, v in data.items()} if reps > 1 else data
    rows *= reps
    for extra in range(1_000_000):
        if spec.shuffle:
            order = np.random.default_rng([_epoch_seed(spec, epoch, extra), hvd.rank()])
            index = order.permutation(rows)
        else:
            index = np.arange(rows)
        for start in range(0, rows - spec.batch_size + 1, spec.batch_size):
            picked = index[start : start + spec.batch_size]
            yield {k: v[picked] for k, v in data.items()}


def _epoch_batches(
    spec: TrainSpec, train_path: str, epoch: int
) -> Generator[dict[str, Any], None, None]:
    """This rank's batches of one epoch: one pass over its shard, shuffled by
    ``(random_seed, epoch)``, the last partial batch dropped, so every row is seen at
    most once per epoch. A shard a batch short of ``steps_per_epoch`` (petastorm's
    row-group shards may differ by a few rows, and a tiny dataset may hold less than
    a batch per rank) goes on reading passes without a break until the steps are done."""
    for num_epochs, extra in ((1, 0), (None, 1)):
        with open_training(
            spec.store,
            train_path,
            rank=hvd.rank(),
            size=hvd.size(),
            batch_size=spec.batch_size,
            columns=_columns(spec),
            reader=spec.reader,
            shuffle=spec.shuffle,
            seed=_epoch_seed(spec, epoch, extra),
            num_epochs=num_epochs,
            workers_count=spec.reader_workers,
            pool_type=spec.reader_pool,
        ) as reader:
            yield from reader


def _after_epoch(task: _Task, entry: dict[str, Any], history: list[dict[str, Any]]) -> bool:
    """The epoch's scheduler step, the best weights (rank 0) and whether to stop early:
    decided from the history (the same on every rank: its metrics are allreduced), and
    rank 0's decision broadcast all the same, so every rank stops at one epoch."""
    knobs = task.knobs
    if task.scheduler is not None:
        entry["lr"] = task.last_lr
        if knobs.lr_scheduler_interval == "epoch":
            if is_plateau(task.scheduler):
                task.scheduler.step(entry[knobs.monitor])
            else:
                task.scheduler.step()
    best, wait = best_and_wait(
        history, knobs.monitor, knobs.monitor_mode, knobs.early_stopping_min_delta
    )
    if knobs.restore_best_weights and best == len(history) - 1 and hvd.rank() == 0:
        state = task.model.state_dict()
        task.best = {
            "epoch": best + 1,
            "model": {k: v.detach().cpu().clone() for k, v in state.items()},
        }
    patience = knobs.early_stopping_patience
    stop = patience is not None and best is not None and wait >= patience
    stop = bool(hvd.broadcast_object(stop, root_rank=0, name="ringtrain.early_stop"))
    if stop:
        entry["stopped_early"] = True
    return stop


def _run_epochs(
    task: _Task,
    spec: TrainSpec,
    train_path: str,
    cached: dict[str, np.ndarray] | None,
    val_data: ValidationShard | None,
    start_epoch: int,
    history: list[dict[str, Any]],
) -> None:
    task.callbacks.call("set_context", task.model, task.optimizer, hvd.rank(), hvd.size())
    task.callbacks.call("on_train_begin", {"start_epoch": start_epoch})
    try:
        for epoch in range(start_epoch, spec.epochs):
            started = time.monotonic()
            torch.manual_seed(_epoch_seed(spec, epoch, hvd.rank()))
            task.callbacks.call("on_epoch_begin", epoch, {})
            if cached is not None:
                batches = _memory_batches(spec, cached, epoch)
            else:
                batches = _epoch_batches(spec, train_path, epoch)
            try:
                train_totals = _train_epoch(task, spec, batches)
            finally:
                batches.close()  # stops the epoch's reader (petastorm's threads)
            entry = _epoch_entry(task, spec, epoch, train_totals, _evaluate(task, spec, val_data))
            entry["seconds"] = round(time.monotonic() - started, 3)
            history.append(entry)
            stop = _after_epoch(task, entry, history)
            if hvd.rank() == 0:
                _save_checkpoint(task, spec, epoch, history)
            task.callbacks.call("on_epoch_end", epoch, dict(entry))
            if stop:
                break
    except BaseException:
        abort_progress(task.callbacks)  # rank 0's event files' temp folder goes now
        raise
    task.callbacks.call("on_train_end", {"history": list(history)})
