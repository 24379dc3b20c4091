"""The data plane's seam: the :class:`Backend` protocol and the registry of backends.

A backend moves bulk tensors once the coordinator has ordered the ops; the engine
calls it from its own thread only. We write no transport: the ring algorithms are
the libraries'. Each backend is made by a factory registered under its name
(``RING_BACKEND``): the factory joins the job's ring and returns a
:class:`Connection` (the backend, the job's store, how to leave). Built in:

- ``gloo`` and ``nccl`` — ``torch.distributed`` (``_torch_ring``, ``_torch_backend``);
  which of the two actually carries CUDA tensors is ``_backend_choice``'s decision;
- ``mpi`` — ``mpi4py`` under ``mpirun`` (``_mpi_backend``).

Where the data plane is CPU-only, ``_host_staged.HostStaged`` wraps it so CUDA tensors
work too. This module imports neither torch nor mpi4py: implementations load when
their factory runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from . import _config as cfg

if TYPE_CHECKING:
    import torch

    from ._ops import ReduceOp
    from ._rendezvous import Rendezvous

__all__ = [
    "Backend",
    "BackendFactory",
    "Connection",
    "lookup_backend",
    "register_backend",
    "registered_backends",
    "requested_backend",
]


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
    (a factory may refine it, e.g. Gloo under mpirun); the job's store, if it opened
    one; and ``close``, what leaving the ring takes (None: nothing)."""

    backend: Backend
    rendezvous: Rendezvous
    store: Any = None
    close: Callable[[], None] | None = None


BackendFactory = Callable[["Rendezvous"], Connection]

_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str, factory: BackendFactory) -> None:
    """Make ``RING_BACKEND=name`` join the ring with ``factory`` (replacing one of that name)."""
    if not name or name != name.strip().lower():
        raise ValueError(f"a backend name is lower case without spaces, got {name!r}")
    _REGISTRY[name] = factory


def registered_backends() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


def lookup_backend(name: str) -> BackendFactory:
    """The factory registered as ``name``; a ValueError listing the registered ones if none."""
    factory = _REGISTRY.get(name)
    if factory is None:
        raise ValueError(
            f"{cfg.BACKEND_ENV_VAR}={name!r} is not a backend; use one of "
            f"{', '.join(registered_backends())} (or register one with "
            "ringcore._backends.register_backend)."
        )
    return factory


def requested_backend(rdv: Rendezvous) -> str:
    """The backend this job asks for: ``RING_BACKEND``, else ``mpi`` under mpirun, else Gloo."""
    name = cfg.get_env(cfg.BACKEND_ENV_VAR) or (
        "mpi" if rdv.source == "mpi" else cfg.DEFAULT_BACKEND
    )
    return name.lower()


def _torch_ring(name: str) -> BackendFactory:
    """The factory of ``name`` ("gloo" or "nccl"): the same ``torch.distributed`` ring,
    with ``name`` as an explicit wish when ``RING_BACKEND`` says so, else chosen."""

    def factory(rdv: Rendezvous) -> Connection:
        from ._torch_ring import connect

        explicit = (cfg.get_env(cfg.BACKEND_ENV_VAR) or "").lower() == name
        return connect(rdv, requested=name if explicit else None)

    return factory


def _mpi(rdv: Rendezvous) -> Connection:
    from ._mpi_backend import connect

    return connect(rdv)


register_backend("gloo", _torch_ring("gloo"))
register_backend("nccl", _torch_ring("nccl"))  # the choice between them: _backend_choice
register_backend("mpi", _mpi)
