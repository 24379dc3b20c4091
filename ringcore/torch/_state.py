"""Broadcasting model and optimizer state from one rank to all."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ._collectives import broadcast_, broadcast_object

__all__ = ["broadcast_optimizer_state", "broadcast_parameters"]


def broadcast_parameters(
    params: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], root_rank: int
) -> None:
    """Overwrite every tensor of ``params`` (a ``state_dict()`` or ``named_parameters()``)
    in place with rank ``root_rank``'s values."""
    if isinstance(params, Mapping):
        items = sorted(params.items())
    else:
        items = list(params)
        for entry in items:
            if not (isinstance(entry, tuple) and len(entry) == 2):
                raise TypeError(
                    "broadcast_parameters takes a state_dict() or named_parameters(), got an "
                    f"iterable of {type(entry).__name__}"
                )
    for name, tensor in items:
        if tensor is None:
            continue
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"broadcast_parameters: {name!r} is a {type(tensor).__name__}, not a tensor"
            )
        with torch.no_grad():
            broadcast_(
                tensor.data if isinstance(tensor, torch.nn.Parameter) else tensor,
                root_rank,
                name=name,
            )


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer, root_rank: int, model: Any = None
) -> None:
    """Make every rank's optimizer state and hyper-parameters equal ``root_rank``'s,
    including state that is still empty before the first step."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"broadcast_optimizer_state takes a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not optimizer.state:
        _zero_missing_grads(optimizer)
    state = broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state")
    optimizer.load_state_dict(state)


def _zero_missing_grads(optimizer: torch.optim.Optimizer) -> None:
    """Before the first step, as Horovod: every parameter that takes gradients gets a
    zero gradient when it has none (frozen parameters keep ``grad=None``), so code that
    reads or broadcasts ``p.grad`` right after the broadcast finds a tensor."""
    sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p)
                p.grad = zero.to_sparse() if sparse else zero
