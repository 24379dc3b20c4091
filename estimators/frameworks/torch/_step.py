"""One batch of the torch loop: its forward, its loss, its optimizer step, its totals.

The totals of a batch are ``[loss * rows, rows, metric * rows, ...]`` as a float64
tensor on the loss's device, so no step syncs with the host: the epoch's sums are read
once, at its end. ``precision`` runs the forward and the loss under ``torch.autocast``;
with ``gradient_clip_val`` the gradients are made final first (under ring: averaged,
``synchronize``), then clipped, then the optimizer steps without reducing again.
"""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import torch

from ._calling import Inputs, inputs_to
from ._losses import batch_loss
from ._task import Task
from ._tensors import as_outputs, as_target, tensor, to_device

__all__ = ["batch_totals", "forward", "minibatch_totals", "optimizer_step", "step_totals", "width"]

Batch = dict[str, np.ndarray]


def width(task: Task, label_cols: list[str]) -> int:
    """The length of a batch's totals: loss, rows, then each metric per label column."""
    return 2 + len(task.metrics) * len(label_cols)


def _scalar(value: Any, device: torch.device | None = None) -> torch.Tensor:
    """A one-element loss or metric value as a 0-d float64 tensor (on its own device)."""
    result = torch.as_tensor(value.detach() if isinstance(value, torch.Tensor) else value)
    if device is not None and result.device != device:
        result = result.to(device)
    return result.to(torch.float64).reshape(())


def batch_totals(
    task: Task, outputs: list[torch.Tensor], targets: list[torch.Tensor], loss: torch.Tensor
) -> torch.Tensor:
    """``[loss * rows, rows, metric * rows, ...]`` of one batch (see the module docstring)."""
    rows = len(targets[0])
    with torch.no_grad():
        values = [_scalar(loss) * rows, loss.new_full((), rows, dtype=torch.float64)]
        for _, fn in task.metrics:
            values.extend(
                _scalar(fn(o, t), loss.device) * rows for o, t in zip(outputs, targets, strict=True)
            )
    return torch.stack(values)


def _total_loss(task: Task, outputs: list, targets: list, weight: Any) -> torch.Tensor:
    """``sum(loss_weights[i] * loss_i)`` over the label columns."""
    parts = zip(task.losses, task.weights, outputs, targets, strict=True)
    total: torch.Tensor = sum(w * batch_loss(fn, o, t, weight) for fn, w, o, t in parts)  # type: ignore[assignment]
    return total


def _batch_tensors(task: Task, spec: Any, batch: Batch) -> tuple[Inputs, list, Any]:
    """``(inputs, labels, sample weights or None)`` of a batch, on the task's device
    (the inputs as the model is called: ``spec.call``)."""
    inputs = inputs_to(spec.call.inputs(batch, spec.feature_cols), task.device)
    labels = [to_device(tensor(batch[c]), task.device) for c in spec.label_cols]
    weight = None
    if spec.sample_weight_col is not None:
        weight = tensor(batch[spec.sample_weight_col]).to(torch.float32).reshape(-1)
        weight = to_device(weight, task.device)
    return inputs, labels, weight


def _autocast(task: Task) -> Any:
    """``precision``: the forward and the loss under ``torch.autocast`` (bf16 / fp16)."""
    dtype = {"bf16": torch.bfloat16, "16": torch.float16}.get(task.config.precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=task.device.type, dtype=dtype)


def forward(
    task: Task, spec: Any, batch: Batch, model: Any = None
) -> tuple[list, list, torch.Tensor]:
    """``(outputs, targets, loss)`` of one batch, through ``model`` (default: the
    task's, the strategy's wrapper)."""
    inputs, labels, weight = _batch_tensors(task, spec, batch)
    call = spec.call
    with _autocast(task):
        result = call(model if model is not None else task.model, inputs, labels)
        outputs = call.outputs(result, len(spec.label_cols))
        targets = [as_target(o, label) for o, label in zip(outputs, labels, strict=True)]
        own = call.own_loss  # the model's loss (outputs.loss), else the loss param's
        loss = call.loss(result) if own else _total_loss(task, outputs, targets, weight)
    return outputs, targets, loss


def step_totals(task: Task, spec: Any, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward one training batch: ``(loss, its totals row)``."""
    outputs, targets, loss = forward(task, spec, batch)
    return loss, batch_totals(task, outputs, targets, loss)


def minibatch_totals(
    task: Task, spec: Any, batch: Batch, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Horovod's ``train_minibatch_fn`` on one batch: it runs the forward, the backward
    and the optimizer steps; returns ``(loss, its totals row)``."""
    (inputs, _), labels, weight = _batch_tensors(task, spec, batch)  # positional: ring's call

    def transform_outputs(outputs: Any, labels: list) -> tuple[list, list]:
        outputs = as_outputs(outputs, len(spec.label_cols))
        return outputs, [as_target(o, t) for o, t in zip(outputs, labels, strict=True)]

    def loss_fn(outputs: list, labels: list, sample_weights: Any) -> torch.Tensor:
        return _total_loss(task, outputs, labels, sample_weights)

    outputs, loss = task.minibatch_fn(
        task.model, task.optimizer, transform_outputs, loss_fn, inputs, labels, weight,
        spec.backward_passes_per_step, step,
    )  # fmt: skip
    outputs, targets = transform_outputs(outputs, labels)
    return loss, batch_totals(task, outputs, targets, loss)


def _clip(task: Task, clip: float) -> None:
    """Clip the final gradients: by the whole model's norm (every fsdp shard counted,
    ``Prepared.clip_grad_norm_``) or elementwise by value."""
    if task.config.gradient_clip_algorithm == "value":
        params = [p for p in task.run.module.parameters() if p.grad is not None]
        torch.nn.utils.clip_grad_value_(params, clip)
    else:
        task.run.clip_grad_norm_(clip)


def optimizer_step(task: Task) -> None:
    """One optimizer step on the averaged gradients: with clipping, the gradients made
    final first (``Prepared.before_step``: the ring's ``synchronize``), clipped, then the
    step without reducing again; with a GradScaler, unscale before clipping. A per-step
    lr_scheduler steps after it."""
    opt, scaler = task.optimizer, task.scaler
    task.last_lr = float(opt.param_groups[0]["lr"])
    clip = task.config.gradient_clip_val
    if clip is not None:
        task.run.before_step()
        if scaler is not None:
            scaler.unscale_(opt)
        _clip(task, clip)
        with task.run.local_step():  # reduced already by before_step()
            scaler.step(opt) if scaler is not None else opt.step()
    elif scaler is not None:
        scaler.step(opt)
    else:
        opt.step()
    if scaler is not None:
        scaler.update()
    opt.zero_grad()
    if task.scheduler is not None and task.config.lr_scheduler_interval == "step":
        task.scheduler.step()
