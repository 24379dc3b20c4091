"""Adasum (Maleki et al., 2020): combine gradients so that orthogonal components add
and parallel ones average. For two vectors a and b:

    adasum(a, b) = (1 - a.b / (2|a|^2)) a + (1 - a.b / (2|b|^2)) b

applied recursively pairwise: at level k each rank combines its running result with
that of the rank ``rank XOR 2^k``. Power-of-two rank counts only.
"""

from __future__ import annotations

import torch


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
