"""The arithmetic around a backend's reduction, as Horovod's C++ core does it: the
scale factors, Average's division, and the neutral element a joined rank contributes."""

from __future__ import annotations

import torch

from ._ops import ReduceOp

__all__ = ["average_", "neutral_fill", "scale_"]


def average_(tensor: torch.Tensor, n: int) -> None:
    """Divide a sum over ``n`` ranks by ``n`` in place: floating and complex tensors
    exactly, integers truncated (as Horovod's C++ core does)."""
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.div_(n)
    else:
        tensor.copy_(torch.div(tensor, n, rounding_mode="trunc"))


def scale_(tensor: torch.Tensor, factor: float) -> None:
    """Multiply ``tensor`` by ``factor`` in place (a prescale or postscale factor)."""
    if factor == 1.0:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.mul_(factor)
    else:  # integers scale as Horovod's C++ core does: multiply, truncate
        tensor.copy_((tensor.to(torch.float64) * factor).trunc().to(tensor.dtype))


def neutral_fill(dtype: torch.dtype, op: int) -> int | float:
    """The value that leaves ``op``'s result unchanged: what a joined rank contributes."""
    if op == ReduceOp.Min:
        return torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    if op == ReduceOp.Max:
        return torch.finfo(dtype).min if dtype.is_floating_point else torch.iinfo(dtype).min
    return 1 if op == ReduceOp.Product else 0
