"""The arithmetic around a backend's reduction, as Horovod's C++ core does it: the
scale factors, Average's division, the neutral element a joined rank contributes, and
Adasum.

Adasum (Maleki et al., 2020) combines gradients so that orthogonal components add
and parallel ones average. For two vectors a and b:

    adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b

applied recursively pairwise: at level k each rank combines its running result with
that of the rank ``rank XOR 2^k``. Power-of-two rank counts only.
"""

from __future__ import annotations

import torch

from .._ops import ReduceOp

__all__ = ["adasum_", "average_", "combine", "is_power_of_two", "neutral_fill", "scale_"]


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


def combine(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """The pairwise Adasum rule, computed in float64 for the dot products."""
    a64, b64 = a.double().reshape(-1), b.double().reshape(-1)
    dot = float(torch.dot(a64, b64))
    na, nb = float(torch.dot(a64, a64)), float(torch.dot(b64, b64))
    ca = 1.0 - dot / (2 * na) if na > 0 else 1.0
    cb = 1.0 - dot / (2 * nb) if nb > 0 else 1.0
    return (ca * a64 + cb * b64).to(a.dtype).reshape(a.shape)


def is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def adasum_(tensor: torch.Tensor, members: list[int], me: int, backend, group) -> torch.Tensor:
    """Reduce ``tensor`` in place with Adasum over ``members`` (global ranks)."""
    n = len(members)
    idx = members.index(me)
    level = 1
    while level < n:
        peer = members[idx ^ level]
        other = torch.empty_like(tensor)
        backend.exchange(tensor, other, peer, group)
        # combine in a fixed order (lower index first) so both sides get identical bits
        low, high = (tensor, other) if idx < (idx ^ level) else (other, tensor)
        tensor.copy_(combine(low, high))
        level <<= 1
    return tensor
