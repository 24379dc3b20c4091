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
import shutil
import time
from collections.abc import Generator, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import cloudpickle
import numpy as np
import torch

import ringcore.torch as hvd
from ringcore.data import make_reader, read_shard

from ._callbacks import CallbackList
from ._lightning import (
    LogRecorder,
    attach_recorder,
    call_hook,
    lightning_optimizer,
    overrides,
    step_loss,
)
from ._metrics import resolve_metrics
from ._spec import DataSpec, writer

__all__ = ["TrainSpec", "as_outputs", "to_device", "to_inputs", "train"]


@dataclass(frozen=True, kw_only=True)
class TrainSpec(DataSpec):
    """Everything a torch / Lightning worker needs, as picklable data (no SparkSession)."""

    user_objects: bytes  # cloudpickle of (model, optimizer class, loss, metrics)
    optimizer_groups: list[list[int]]  # per param group: indices into model.parameters()
    optimizer_state: dict[str, Any]  # the driver optimizer's state_dict()
    lightning: bool = False  # a LightningModule: its own configure_optimizers / training_step
    use_gpu: bool = False  # model and batches on cuda:<local rank>
    inmemory_cache_all: bool = False  # read the shard once, serve every epoch from memory


@dataclass
class _Task:
    """What this worker rebuilt from the spec."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Any
    metrics: list[tuple[str, Any]]
    callbacks: CallbackList
    device: torch.device
    scheduler: Any = None  # a LightningModule's lr scheduler
    scheduler_interval: str = "epoch"
    recorder: LogRecorder | None = None  # a LightningModule's self.log values

    @property
    def lightning(self) -> bool:
        return self.recorder is not None


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


def _rebuild(spec: TrainSpec) -> _Task:
    model, optimizer_cls, loss, metrics, callbacks = cloudpickle.loads(spec.user_objects)
    device = _device(spec)
    model.to(device)
    scheduler, interval, recorder = None, "epoch", None
    if spec.lightning:
        base, scheduler, interval = lightning_optimizer(model)
        recorder = attach_recorder(model)
    else:
        base = _torch_optimizer(spec, model, optimizer_cls)
    optimizer = hvd.DistributedOptimizer(
        base,
        named_parameters=model.named_parameters(),
        backward_passes_per_step=spec.backward_passes_per_step,
    )
    if not spec.lightning:
        optimizer.load_state_dict(spec.optimizer_state)  # the driver's hyper-parameters
    task = _Task(model, optimizer, loss, resolve_metrics(metrics), CallbackList(callbacks), device)
    task.scheduler, task.scheduler_interval, task.recorder = scheduler, interval, recorder
    return task


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


def _load_validation(spec: TrainSpec, local_path: str | None) -> dict[str, np.ndarray] | None:
    if local_path is None:
        return None
    return read_shard(
        local_path, rank=hvd.rank(), size=hvd.size(), columns=_columns(spec), reader=spec.reader
    )


def _load_shard(spec: TrainSpec, local_path: str) -> dict[str, np.ndarray]:
    return read_shard(
        local_path, rank=hvd.rank(), size=hvd.size(), columns=_columns(spec), reader=spec.reader
    )


def _transformed(spec: TrainSpec, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return batch if spec.transformation_fn is None else spec.transformation_fn(batch)


@contextlib.contextmanager
def _local_copies(spec: TrainSpec) -> Iterator[tuple[str, str | None]]:
    """Local paths of the training and validation data: the store's own when it is
    local, else copies fetched through fsspec (removed afterwards)."""
    if spec.store.is_local():
        yield spec.train_path, spec.val_path
        return
    train_path = spec.store.localize(spec.train_path)
    try:
        val_path = spec.store.localize(spec.val_path) if spec.val_path is not None else None
    except BaseException:  # the training copy is not left behind
        shutil.rmtree(os.path.dirname(train_path), ignore_errors=True)
        raise
    try:
        yield train_path, val_path
    finally:
        for path in (train_path, val_path):
            if path is not None:
                shutil.rmtree(os.path.dirname(path), ignore_errors=True)


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


def _loss(task: _Task, output: torch.Tensor, target: torch.Tensor, weight: Any) -> torch.Tensor:
    """The batch's loss; with sample weights, ``mean(weight * per-row loss)`` (as Keras)."""
    if weight is None:
        return task.loss(output, target)
    return (_per_row_loss(task.loss, output, target) * weight).mean()


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``; to a GPU through pinned memory without blocking the host
    (torch's caching host allocator keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


def _forward(task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray]):
    inputs = [to_device(t, task.device) for t in to_inputs(batch, spec.feature_cols)]
    outputs = as_outputs(task.model(*inputs), len(spec.label_cols))
    targets = [
        _as_target(o, to_device(_tensor(batch[c]), task.device))
        for o, c in zip(outputs, spec.label_cols, strict=True)
    ]
    weight = None
    if spec.sample_weight_col is not None:
        weight = _tensor(batch[spec.sample_weight_col]).to(torch.float32).reshape(-1)
        weight = to_device(weight, task.device)
    loss = sum(_loss(task, o, t, weight) for o, t in zip(outputs, targets, strict=True))
    return outputs, targets, loss


def _lightning_batch(task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray]) -> dict:
    """``{column: tensor}``: features float32, labels and weights as stored."""
    tensors = {c: to_device(_tensor(batch[c]), task.device) for c in _columns(spec)}
    for c in spec.feature_cols:
        tensors[c] = tensors[c].to(torch.float32)
    return tensors


def _lightning_step(
    task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray], index: int, method: str
) -> tuple[torch.Tensor | None, int]:
    """``(loss or None, rows)`` of ``training_step`` / ``validation_step`` on ``batch``."""
    assert task.recorder is not None
    rows = len(batch[spec.label_cols[0]])
    task.recorder.weight = float(rows)
    try:
        result = getattr(task.model, method)(_lightning_batch(task, spec, batch), index)
    finally:
        task.recorder.weight = 1.0
    return step_loss(result, method), rows


def _step_totals(task: _Task, spec: TrainSpec, batch: dict[str, np.ndarray], step: int):
    """Forward one training batch: ``(loss, its totals row)``."""
    if task.lightning:
        loss, rows = _lightning_step(task, spec, batch, step, "training_step")
        if loss is None:
            raise ValueError(
                "training_step returned None; ringtrain does not skip steps (every rank "
                "must step together). Return the loss."
            )
        totals = torch.stack([_scalar(loss) * rows, loss.new_full((), rows, dtype=torch.float64)])
        return loss, totals
    outputs, targets, loss = _forward(task, spec, batch)
    return loss, _batch_totals(task, spec, outputs, targets, loss)


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
        loss, row = _step_totals(task, spec, _transformed(spec, batch), step)
        loss.backward()
        if (step + 1) % every == 0 or step + 1 == spec.steps_per_epoch:
            task.optimizer.step()
            task.optimizer.zero_grad()
            if task.scheduler is not None and task.scheduler_interval == "step":
                task.scheduler.step()
        totals += row
        if task.callbacks:
            loss_sum, rows = row[:2].tolist()  # a host sync, only when callbacks want it
            task.callbacks.call("on_batch_end", step, {"loss": loss_sum / rows, "rows": rows})
    return totals.cpu().numpy()


def _val_batches(spec: TrainSpec, data: dict[str, np.ndarray]) -> Iterator[dict[str, np.ndarray]]:
    rows = len(data[spec.label_cols[0]])
    if spec.val_steps is not None:
        rows = min(rows, spec.val_steps * spec.val_batch_size)
    for start in range(0, rows, spec.val_batch_size):
        batch = {k: v[start : min(rows, start + spec.val_batch_size)] for k, v in data.items()}
        yield _transformed(spec, batch)


def _evaluate(task: _Task, spec: TrainSpec, data: dict[str, np.ndarray] | None) -> np.ndarray:
    totals = np.zeros(_width(task, spec))
    if data is None:
        return totals
    task.model.eval()
    with torch.no_grad():
        if task.lightning:
            return _evaluate_lightning(task, spec, data, totals)
        summed = torch.zeros(len(totals), dtype=torch.float64, device=task.device)
        for batch in _val_batches(spec, data):
            outputs, targets, loss = _forward(task, spec, batch)
            summed += _batch_totals(task, spec, outputs, targets, loss)
    return summed.cpu().numpy()


def _evaluate_lightning(
    task: _Task, spec: TrainSpec, data: dict[str, np.ndarray], totals: np.ndarray
) -> np.ndarray:
    if not overrides(task.model, "validation_step"):
        return totals  # no validation_step: no validation metrics
    assert task.recorder is not None
    task.recorder.phase = "val"
    try:
        call_hook(task.model, "on_validation_epoch_start")
        for index, batch in enumerate(_val_batches(spec, data)):
            loss, rows = _lightning_step(task, spec, batch, index, "validation_step")
            totals[1] += rows
            if loss is not None:
                totals[0] += float(loss) * rows
        call_hook(task.model, "on_validation_epoch_end")
    finally:
        task.recorder.phase = "train"
    return totals


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
    if task.recorder is not None:
        entry.update(_logged_means(task.recorder))
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
    """Rank 0, after each epoch: written to a temporary name and renamed (write_atomic),
    so a worker killed meanwhile leaves the previous checkpoint whole."""
    state = {  # CPU copies: the driver (maybe without a GPU) loads this checkpoint
        "model": _on_cpu(task.model.state_dict()),
        "optimizer": _on_cpu(task.optimizer.state_dict()),
        "epoch": epoch + 1,
        "history": history,
    }
    if task.scheduler is not None:
        state["scheduler"] = task.scheduler.state_dict()
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
        with make_reader(
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
        ) as reader:
            yield from reader


def _run_epochs(
    task: _Task,
    spec: TrainSpec,
    train_path: str,
    cached: dict[str, np.ndarray] | None,
    val_data: dict[str, np.ndarray] | None,
    start_epoch: int,
    history: list[dict[str, Any]],
) -> None:
    task.callbacks.call("set_context", task.model, task.optimizer, hvd.rank(), hvd.size())
    task.callbacks.call("on_train_begin", {"start_epoch": start_epoch})
    if task.lightning:
        call_hook(task.model, "on_train_start")
    for epoch in range(start_epoch, spec.epochs):
        started = time.monotonic()
        torch.manual_seed(_epoch_seed(spec, epoch, hvd.rank()))
        task.callbacks.call("on_epoch_begin", epoch, {})
        if task.lightning:
            call_hook(task.model, "on_train_epoch_start")
        if cached is not None:
            batches = _memory_batches(spec, cached, epoch)
        else:
            batches = _epoch_batches(spec, train_path, epoch)
        try:
            train_totals = _train_epoch(task, spec, batches)
        finally:
            batches.close()  # stops the epoch's reader (petastorm's threads)
        if task.lightning:
            call_hook(task.model, "on_train_epoch_end")
        if task.scheduler is not None and task.scheduler_interval == "epoch":
            task.scheduler.step()
        entry = _epoch_entry(task, spec, epoch, train_totals, _evaluate(task, spec, val_data))
        entry["seconds"] = round(time.monotonic() - started, 3)
        history.append(entry)
        if hvd.rank() == 0:
            _save_checkpoint(task, spec, epoch, history)
        task.callbacks.call("on_epoch_end", epoch, dict(entry))
    if task.lightning:
        call_hook(task.model, "on_train_end")
    task.callbacks.call("on_train_end", {"history": list(history)})
