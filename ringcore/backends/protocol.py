"""The data plane's seam: what the engine needs from a backend, and what joining one gives.

A backend moves bulk tensors once the coordinator has ordered the ops; the engine
calls it from its own thread only. A backend's factory (``backends.registry``) joins
the job's ring and returns a :class:`Connection`. This module imports no framework:
``torch`` appears in annotations only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from .._ops import ReduceOp
    from ..rendezvous.environment import Rendezvous

__all__ = ["Backend", "BackendFactory", "Connection"]


class Backend(Protocol):
    """What the engine needs from a data plane. ``group``: a handle from
    :meth:`new_group` (None: every rank); ``members``: the group's global ranks."""

    name: str

    def allreduce(self, t: torch.Tensor, op: ReduceOp, group: Any) -> None: ...

    def allgather(self, t: torch.Tensor, dims: list[int], group: Any) -> torch.Tensor: ...

    def broadcast(self, t: torch.Tensor, root: int, members: list[int], group: Any) -> None: ...

    def alltoall(
        self, t: torch.Tensor, send: list[int], recv: list[int], group: Any
    ) -> torch.Tensor: ...

    def barrier(self, group: Any) -> None: ...

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any) -> None: ...

    def new_group(self, ranks: list[int], size: int) -> Any: ...

    def broadcast_object(self, obj: Any, root: int = 0) -> Any: ...


@dataclass(frozen=True)
class Connection:
    """What a backend's factory returns: the backend; the rendezvous it joined through
    (a factory may refine it, e.g. Gloo under mpirun); ``close``, what leaving the ring
    takes (None: nothing); and, when the ranks met through a store of the job, the
    ring's view of it (``store``: its keys under ``prefix``, a name no other ring of the
    job uses). With ``store`` and ``prefix`` the runtime puts the host's shared-memory
    plane in front of the backend (``ringcore.shm.layer``); without them (MPI's own
    world, a ``torch.distributed`` group formed by someone else) the backend carries
    every op."""

    backend: Backend
    rendezvous: Rendezvous
    store: Any = None
    close: Callable[[], None] | None = None
    prefix: str = ""


BackendFactory = Callable[["Rendezvous"], Connection]
