"""A batch's loss for one label column, with per-row sample weights or without."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["batch_loss", "per_row_loss"]


def per_row_loss(loss_fn: Any, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
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


def batch_loss(
    loss_fn: Any, output: torch.Tensor, target: torch.Tensor, weight: Any
) -> torch.Tensor:
    """The batch's loss; with sample weights, ``mean(weight * per-row loss)`` (as Keras)."""
    if weight is None:
        return loss_fn(output, target)
    return (per_row_loss(loss_fn, output, target) * weight).mean()
