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
    state = broadcast_object(optimizer.state_dict(), root_rank, name="optimizer_state")
    optimizer.load_state_dict(state)
