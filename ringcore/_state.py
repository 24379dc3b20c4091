"""The runtime state of this process, and what every layer reads from it.

A leaf module: it imports nothing of ringcore's above it, so the engine, the process
sets, device pinning and the bindings read the running job here (``rank()``,
``engine()``, ...) while ``_runtime`` alone creates and clears it (``init()`` /
``shutdown()``, under :data:`lock`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ._errors import NotInitializedError
from ._timeline import Timeline

if TYPE_CHECKING:
    from ._backends import Connection
    from ._rendezvous import Rendezvous
    from ._topology import Topology

__all__ = [
    "RuntimeState",
    "backend_name",
    "cross_rank",
    "cross_size",
    "current",
    "dynamic_process_sets_enabled",
    "engine",
    "get",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "lock",
    "rank",
    "size",
    "timeline",
    "topology",
]


@dataclass
class RuntimeState:
    """One joined job: where this rank sits, how it joined, and what runs its ops.

    ``connection``: what the backend's factory made (the backend, the store, how to
    leave); ``engine``/``coordinator`` (rank 0 only): set once they have started.
    """

    topology: Topology
    rendezvous: Rendezvous
    connection: Connection
    engine: Any = None
    coordinator: Any = None
    dynamic_process_sets: bool = False


lock = threading.RLock()  # held by init() and shutdown()
current: RuntimeState | None = None  # set by _runtime only
timeline = Timeline()


def get() -> RuntimeState:
    """The running job's state; raises :class:`NotInitializedError` before ``init()``."""
    state = current
    if state is None:
        raise NotInitializedError()
    return state


def is_initialized() -> bool:
    return current is not None


def engine() -> Any:
    return get().engine


def topology() -> Topology:
    return get().topology


def backend_name() -> str | None:
    """The data-plane backend of the running job ("gloo", "mpi", ...), None before init()."""
    state = current
    return None if state is None or state.engine is None else state.engine.backend.name


def data_plane() -> dict[str, Any] | None:
    """What carries this rank's tensors, None before init(): ``backend`` (as
    :func:`backend_name`), ``mode`` ("flat" or "hierarchical" when the shared-memory
    plane holds, "network" otherwise), ``ops`` (how many ops each path carried) and
    ``engine`` (the control path's counters: cached-id and full requests)."""
    state = current
    if state is None or state.engine is None:
        return None
    backend = state.engine.backend
    mode = getattr(backend, "mode", None)
    return {
        "backend": backend.name,
        "mode": mode if mode in ("flat", "hierarchical") else "network",
        "ops": dict(getattr(backend, "stats", {})),
        "engine": dict(getattr(state.engine, "stats", {})),
    }


def dynamic_process_sets_enabled() -> bool:
    state = current
    return bool(state and state.dynamic_process_sets)


def rank() -> int:
    return topology().rank


def size() -> int:
    return topology().size


def local_rank() -> int:
    return topology().local_rank


def local_size() -> int:
    return topology().local_size


def cross_rank() -> int:
    return topology().cross_rank


def cross_size() -> int:
    return topology().cross_size


def is_homogeneous() -> bool:
    return topology().is_homogeneous
