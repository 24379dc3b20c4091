"""Tensors in and out of a torch model: a batch's inputs, its outputs, its targets.

The model takes one float32 tensor per feature column (a scalar column as ``(rows, 1)``)
and returns one tensor per label column; :func:`as_target` meets the loss halfway on
the label's shape and dtype. Shared by the worker's loop, the driver's first-batch
check and ``RingModel.transform``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = ["as_outputs", "as_target", "on_cpu", "tensor", "to_device", "to_inputs"]


def tensor(values: np.ndarray) -> torch.Tensor:
    """``values`` as a tensor sharing its memory (a copy when numpy's is read-only)."""
    return torch.from_numpy(values if values.flags.writeable else values.copy())


def to_inputs(batch: dict[str, np.ndarray], feature_cols: list[str]) -> list[torch.Tensor]:
    """Model inputs: float32 tensors; a scalar column becomes shape (rows, 1)."""
    inputs = []
    for col in feature_cols:
        value = tensor(batch[col]).to(torch.float32)
        inputs.append(value.view(-1, 1) if value.dim() == 1 else value)
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


def as_target(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Meet the loss halfway: a (rows,) label against a (rows, 1) output becomes (rows, 1)
    of the output's dtype; a float (rows,) label against (rows, classes) logits
    becomes class indices (Spark ML labels are doubles)."""
    if label.dim() == 1 and output.dim() == 2:
        if output.shape[1] == 1:
            return label.view(-1, 1).to(output.dtype)
        if label.is_floating_point():
            return label.to(torch.long)
    return label


def to_device(value: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``value`` on ``device``; to a GPU through pinned memory without blocking the host
    (torch's caching host allocator keeps the pinned buffer until the copy is done)."""
    if device.type != "cuda":
        return value
    return value.pin_memory().to(device, non_blocking=True)


def on_cpu(value: Any) -> Any:
    """``value`` (a state_dict, nested dicts / lists) with every tensor copied to the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: on_cpu(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(on_cpu(v) for v in value)
    return value
