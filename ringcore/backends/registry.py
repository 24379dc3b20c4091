"""The open registry of backends: a factory per name that ``RING_BACKEND`` accepts.

We write no transport: the ring algorithms are the libraries'. Each backend is made by
a factory registered under its name (``ringcore.launch.register_backend``): the factory
joins the job's ring and returns a :class:`~ringcore.backends.protocol.Connection`.
Built in:

- ``gloo`` and ``nccl`` — ``torch.distributed`` (``torch_ring``, ``torch_backend``);
  which of the two actually carries CUDA tensors is ``choice``'s decision;
- ``mpi`` — ``mpi4py`` under ``mpirun`` (``mpi``).

Where the data plane is CPU-only, ``host_staged.HostStaged`` wraps it so CUDA tensors
work too. This module imports neither torch nor mpi4py: they load when a factory runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .. import _config as cfg
from . import torch_ring  # torch: imported only when a ring forms
from .protocol import BackendFactory, Connection

if TYPE_CHECKING:
    from ..rendezvous.environment import Rendezvous

__all__ = [
    "lookup_backend",
    "register_backend",
    "registered_backends",
    "requested_backend",
]


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
            "ringcore.launch.register_backend)."
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
        explicit = (cfg.get_env(cfg.BACKEND_ENV_VAR) or "").lower() == name
        return torch_ring.connect(rdv, requested=name if explicit else None)

    return factory


def _mpi(rdv: Rendezvous) -> Connection:
    from . import mpi  # mpi4py and torch: imported when an MPI job joins

    return mpi.connect(rdv)


register_backend("gloo", _torch_ring("gloo"))
register_backend("nccl", _torch_ring("nccl"))  # the choice between them: choice
register_backend("mpi", _mpi)
