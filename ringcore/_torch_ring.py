"""Forming the ``torch.distributed`` ring: the factory of the ``gloo`` and ``nccl`` backends.

Three ways in: a group someone already formed (a ``torchrun`` script, a test) is
adopted; under ``mpirun`` rank 0 hosts a store and MPI tells every rank where;
otherwise the ranks meet at the job's store, check in, and form a Gloo (or
``cpu:gloo,cuda:nccl``) process group, on the interface on the route to the store.
A ring formed here then puts the host's shared-memory data plane in front of the
network backend where it applies (``_shm_backend.join``); an adopted group keeps the
network path (there is no store of ours to meet through). torch is imported only
when a ring is formed.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

from . import _config as cfg
from ._backends import Connection
from ._errors import RendezvousError
from ._rendezvous import Rendezvous, hosted_store
from ._store_server import host_store

log = logging.getLogger("ringtrain.ringcore")

__all__ = ["connect", "is_loopback"]


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("localhost", "::1")


def connect(rdv: Rendezvous, requested: str | None = None) -> Connection:
    """Join (or adopt) the ring of ``rdv``'s job; the backend moves tensors through it.
    ``requested``: "gloo" or "nccl" as asked for, None to choose (``_backend_choice``)."""
    import torch.distributed as dist

    from . import _shm_backend
    from ._torch_backend import torch_backend

    if rdv.source == "mpi":
        rdv = _gloo_under_mpi(rdv)
    if dist.is_initialized():
        _check_adopted(dist, rdv)
        return Connection(torch_backend(), rdv)
    store, prefixed, prefix = _form_group(rdv, requested)
    try:
        backend = _shm_backend.join(
            torch_backend(),
            prefixed,
            prefix,
            rdv.topology,
            cfg.get_float(cfg.GLOO_TIMEOUT_ENV_VAR, cfg.DEFAULT_GLOO_TIMEOUT_S),
        )
    except BaseException:
        _destroy_group()
        raise
    return Connection(backend, rdv, store=store, close=lambda: _leave(backend))


def _timeout(env_var: str, default_s: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=cfg.get_float(env_var, default_s))


def _check_adopted(dist: Any, rdv: Rendezvous) -> None:
    """A default group formed by someone else must be the job's own ring."""
    topo = rdv.topology
    if dist.get_world_size() != topo.size or dist.get_rank() != topo.rank:
        raise RendezvousError(
            f"torch.distributed is already initialized as rank {dist.get_rank()} of "
            f"{dist.get_world_size()}, but the environment says rank {topo.rank} of "
            f"{topo.size}. Destroy that process group first or fix the environment."
        )


def _form_group(rdv: Rendezvous, requested: str | None) -> tuple[Any, Any, str]:
    """Meet at the store, check in, and form the default process group; returns the
    store, the ring's view of it (under this generation's prefix) and that prefix."""
    import torch.distributed as dist

    from . import _iface
    from ._backend_choice import plan  # gloo, or cpu:gloo,cuda:nccl with this rank's GPU pinned

    topo = rdv.topology
    start_timeout = _timeout(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
    # A store *named* by a hostname that resolves to loopback here only (rank 0's own
    # name in /etc/hosts) must not put a multi-host ring on lo; a literal 127.x is local.
    spans_hosts = topo.local_size < topo.size and not is_loopback(rdv.store_addr)
    iface = _iface.apply(rdv.store_addr, rdv.store_port, spans_hosts)
    store = _open_store(rdv, start_timeout)
    prefix = (
        os.environ.get(cfg.STORE_PREFIX_ENV_VAR) or f"ringcore/{_rings_formed(store, topo.rank)}"
    )
    prefixed = dist.PrefixStore(prefix, store)
    _await_ranks(prefixed, rdv, start_timeout)
    backend = plan(topo, prefixed, requested).process_group or "gloo"
    try:
        dist.init_process_group(
            backend,
            store=prefixed,
            rank=topo.rank,
            world_size=topo.size,
            timeout=_timeout(cfg.GLOO_TIMEOUT_ENV_VAR, cfg.DEFAULT_GLOO_TIMEOUT_S),
        )
    except Exception as exc:
        raise RendezvousError(
            f"rank {topo.rank} of {topo.size} could not form the {backend} ring through "
            f"{rdv.store_addr}:{rdv.store_port} ({type(exc).__name__}: {exc}). This rank's "
            f"data plane is on interface {iface.name or 'chosen by Gloo'} ({iface.reason}): "
            f"if peers cannot reach it, set {cfg.IFACE_ENV_VAR} to the interface that "
            "reaches the other hosts, and let TCP between the hosts through (docs/cluster.md)."
        ) from exc
    return store, prefixed, prefix


def _rings_formed(store: Any, rank: int) -> int:
    """How many rings this rank has formed through this store, this one included: the
    prefix of the ring's keys. It is counted in the store, not in the process: the store
    lives as long as the job, so every rank of a job gets the same number whatever its
    process did before. A process-wide count gave a Python worker that Spark reused
    across jobs (each job with its own store) a number its peers did not have, and the
    ranks waited for each other under two prefixes until RING_START_TIMEOUT."""
    return int(store.add(f"ringcore/formed/{rank}", 1))


def _leave(backend: Any) -> None:
    """Leave the ring: the host's shared-memory group (if any), then the process group."""
    try:
        close = getattr(backend, "close", None)
        if close is not None:
            close()
    finally:
        _destroy_group()


def _destroy_group() -> None:
    """Leave the process group this module formed (a dead peer must not make it fail)."""
    import torch.distributed as dist

    from . import _iface

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:
            log.debug("destroy_process_group failed: %s", exc)
    _iface.restore()


def _open_store(rdv: Rendezvous, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    if rdv.topology.size == 1 and rdv.store_port == 0:
        return dist.HashStore()
    hosted = hosted_store(rdv.store_port)
    if hosted is not None:
        return hosted
    addr, port, size = rdv.store_addr, rdv.store_port, rdv.topology.size
    try:
        if rdv.is_store_host:  # kept past shutdown(): the next init() meets here (_store_server)
            return host_store(addr, port, size, timeout.total_seconds())
        return dist.TCPStore(addr, port, size, False, timeout=timeout, wait_for_workers=False)
    except Exception as exc:  # torch raises RuntimeError / DistStoreError / TimeoutError
        role = "host" if rdv.is_store_host else "reach"
        raise RendezvousError(
            f"rank {rdv.topology.rank} could not {role} the job's store at "
            f"{rdv.store_addr}:{rdv.store_port} within {timeout.total_seconds():.0f} s "
            f"({type(exc).__name__}: {exc}). Check that rank 0 started and that the port is "
            f"reachable, or raise {cfg.START_TIMEOUT_ENV_VAR}."
        ) from exc


#: how often a rank waiting at an elastic rendezvous looks for a newer generation
_SUPERSEDED_POLL_S = 1.0


def _await_ranks(store: Any, rdv: Rendezvous, timeout: datetime.timedelta) -> None:
    """Every rank checks in at the store; when one never arrives, the others fail
    within ``timeout`` with a message naming it (not the backend's own timeout).

    In an elastic job, while re-forming the ring (``elastic.rejoin``), a rank also stops
    waiting once the launcher has published a newer generation: a rank that already
    moved to it never arrives here, so the wait could only end at the timeout; rejoin
    then joins the newest."""
    topo = rdv.topology
    if topo.size == 1:
        return
    keys = [f"arrived/{r}" for r in range(topo.size)]
    store.set(keys[topo.rank], "1")
    from . import _elastic

    elastic = _elastic.rejoining()  # see rejoining(); only ever true in an elastic job
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        step = min(left, _SUPERSEDED_POLL_S) if elastic else left
        try:
            store.wait(keys, datetime.timedelta(seconds=max(step, 0.001)))
            return
        except Exception:  # torch raises DistStoreError / RuntimeError on timeout
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return
        if elastic and _elastic.hosts_updated():
            raise RendezvousError(
                f"rank {topo.rank} of {topo.size}: generation {_elastic.joined_generation()} "
                f"of the ring was superseded while ranks {missing} had not arrived"
            )
        if time.monotonic() >= deadline:
            break
    raise RendezvousError(
        f"rank {topo.rank} of {topo.size}: ranks {missing} did not arrive at the rendezvous "
        f"(store {rdv.store_addr}:{rdv.store_port}) within {timeout.total_seconds():.0f} s. "
        f"Check that those ranks started (see their output), or raise {cfg.START_TIMEOUT_ENV_VAR}."
    ) from None


def _gloo_under_mpi(rdv: Rendezvous) -> Rendezvous:
    """Gloo chosen under mpirun: rank 0 hosts the store; MPI tells everyone where."""
    import socket
    from dataclasses import replace

    from mpi4py import MPI

    from ._rendezvous import start_store_server

    comm = MPI.COMM_WORLD
    single_host = rdv.topology.local_size == rdv.topology.size
    addr = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
    port = start_store_server(world_size=rdv.topology.size) if rdv.topology.rank == 0 else 0
    addr, port = comm.bcast((addr, port), root=0)
    return replace(rdv, store_addr=addr, store_port=port, source="mpi+gloo")
