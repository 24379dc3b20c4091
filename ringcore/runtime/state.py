"""The runtime state of this process, and what the layers above read from it.

The process sets, the public queries and the bindings read the running job here
(``rank()``, ``engine()``, ``wait_handle``, ...) while ``lifecycle`` alone creates and
clears it (``init()`` / ``shutdown()``, under :data:`lock`). It imports no room above
the engine: the engine and the backends never read it (what they need is passed to them
when the job starts).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import _config as cfg
from .._errors import NotInitializedError
from ..engine.timeline import Timeline

if TYPE_CHECKING:
    from ..backends.protocol import Backend, Connection
    from ..rendezvous.environment import Rendezvous
    from ..rendezvous.topology import Topology

__all__ = [
    "RuntimeState",
    "backend_name",
    "cross_rank",
    "cross_size",
    "current",
    "data_plane",
    "dynamic_process_sets_enabled",
    "engine",
    "get",
    "is_homogeneous",
    "is_initialized",
    "local_position",
    "local_rank",
    "local_size",
    "lock",
    "rank",
    "size",
    "timeline",
    "topology",
    "wait_handle",
]


@dataclass
class RuntimeState:
    """One joined job: where this rank sits, how it joined, and what runs its ops.

    ``connection``: what the backend's factory made (the backend, the store, how to
    leave); ``backend``: what carries the ops (the connection's backend, with the host's
    shared-memory plane in front of it where that applies); ``engine``/``coordinator``
    (rank 0 only): set once they have started.
    """

    topology: Topology
    rendezvous: Rendezvous
    connection: Connection
    backend: Backend
    engine: Any = None
    coordinator: Any = None
    dynamic_process_sets: bool = False


lock = threading.RLock()  # held by init() and shutdown()
current: RuntimeState | None = None  # set by lifecycle only
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


def local_position() -> tuple[int, int]:
    """``(local_rank, local_size)`` of this rank: the running job's, else
    ``RING_LOCAL_RANK``/``RING_LOCAL_SIZE`` (0 and 1 when unset)."""
    state = current
    if state is not None:
        return state.topology.local_rank, state.topology.local_size
    return cfg.get_int(cfg.LOCAL_RANK_ENV_VAR, 0), cfg.get_int(cfg.LOCAL_SIZE_ENV_VAR, 1)


def wait_handle(handle: Any) -> None:
    """Wait for a handle of the running engine (``Engine.wait``: the fast lane, or its
    queued requests sent first)."""
    if handle.done.is_set():
        return
    state = current
    if state is not None and state.engine is not None:
        state.engine.wait(handle)
        return
    handle.done.wait()
