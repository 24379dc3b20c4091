"""Lifecycle and topology of this process: ``init()``, ``shutdown()``, ``rank()``, ...

``init()`` reads the rendezvous from the environment (see ``_rendezvous``), opens
the job's store and the backend's process group. The backend is Gloo through
``torch.distributed``; torch is imported here only when ``init()`` runs, so
``import ringcore`` stays light.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from . import _config as cfg
from ._errors import NotInitializedError, RendezvousError, RingInternalError
from ._rendezvous import Rendezvous, hosted_store, read_environment
from ._topology import Topology

log = logging.getLogger("ringtrain.ringcore")

__all__ = [
    "cross_rank",
    "cross_size",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]


@dataclass
class _State:
    topology: Topology
    rendezvous: Rendezvous
    store: Any
    owns_process_group: bool


_lock = threading.RLock()
_state: _State | None = None
_generation = 0


def _is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("localhost", "::1")


def _open_store(rdv: Rendezvous, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    if rdv.topology.size == 1 and rdv.store_port == 0:
        return dist.HashStore()
    hosted = hosted_store(rdv.store_port)
    if hosted is not None:
        return hosted
    try:
        return dist.TCPStore(
            rdv.store_addr,
            rdv.store_port,
            rdv.topology.size,
            rdv.is_store_host,
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as exc:  # torch raises RuntimeError / DistStoreError / TimeoutError
        role = "host" if rdv.is_store_host else "reach"
        raise RendezvousError(
            f"rank {rdv.topology.rank} could not {role} the job's store at "
            f"{rdv.store_addr}:{rdv.store_port} within {timeout.total_seconds():.0f} s "
            f"({type(exc).__name__}: {exc}). Check that rank 0 started and that the port is "
            f"reachable, or raise {cfg.START_TIMEOUT_ENV_VAR}."
        ) from exc


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job described by the environment. Idempotent; works again after shutdown()."""
    global _state, _generation
    if comm is not None or process_sets is not None:
        raise NotImplementedError(
            "init(comm=..., process_sets=...) is not supported yet; call init() and use the "
            "global process set."
        )
    with _lock:
        if _state is not None:
            return
        import torch.distributed as dist

        rdv = read_environment()
        topo = rdv.topology
        start_timeout = datetime.timedelta(
            seconds=cfg.get_float(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
        )
        op_timeout = datetime.timedelta(
            seconds=cfg.get_float(cfg.GLOO_TIMEOUT_ENV_VAR, cfg.DEFAULT_GLOO_TIMEOUT_S)
        )
        if dist.is_initialized():
            # Someone (a torchrun script, a test) already formed the default group: adopt it.
            if dist.get_world_size() != topo.size or dist.get_rank() != topo.rank:
                raise RendezvousError(
                    f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                    f"{dist.get_world_size()}, but the environment says rank {topo.rank} of "
                    f"{topo.size}. Destroy that process group first or fix the environment."
                )
            _state = _State(topo, rdv, None, owns_process_group=False)
            return
        if _is_loopback(rdv.store_addr):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
        backend = (cfg.get_env(cfg.BACKEND_ENV_VAR) or cfg.DEFAULT_BACKEND).lower()
        if backend != "gloo":
            raise ValueError(f"{cfg.BACKEND_ENV_VAR}={backend!r} is not supported yet; use 'gloo'.")
        store = _open_store(rdv, start_timeout)
        _generation += 1
        prefixed = dist.PrefixStore(f"ringcore/{_generation}", store)
        try:
            dist.init_process_group(
                backend, store=prefixed, rank=topo.rank, world_size=topo.size, timeout=op_timeout
            )
        except Exception as exc:
            raise RendezvousError(
                f"rank {topo.rank} of {topo.size} could not form the Gloo ring through "
                f"{rdv.store_addr}:{rdv.store_port} ({type(exc).__name__}: {exc})."
            ) from exc
        _state = _State(topo, rdv, store, owns_process_group=True)
        log.debug("rank %d/%d joined through %s", topo.rank, topo.size, rdv.source)


def shutdown() -> None:
    """Leave the job; ``init()`` may be called again afterwards."""
    global _state
    with _lock:
        if _state is None:
            return
        if _state.owns_process_group:
            import torch.distributed as dist

            if dist.is_initialized():
                try:
                    dist.destroy_process_group()
                except Exception as exc:  # a dead peer must not make shutdown fail
                    log.debug("destroy_process_group failed: %s", exc)
        _state = None


def is_initialized() -> bool:
    return _state is not None


def topology() -> Topology:
    state = _state
    if state is None:
        raise NotInitializedError()
    return state.topology


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


def translate_backend_error(exc: BaseException, what: str) -> RingInternalError:
    """Wrap a backend failure (a peer died, a timeout) in RingInternalError."""
    return RingInternalError(
        f"{what} could not complete on rank {rank()} of {size()}: {type(exc).__name__}: {exc}. "
        "A peer may have died; an elastic job restores its last commit and retries."
    )
