"""Forming the ``torch.distributed`` ring: the factory of the ``gloo`` and ``nccl`` backends.

Three ways in: a group someone already formed (a ``torchrun`` script, a test) is
adopted; under ``mpirun`` rank 0 hosts a store and MPI tells every rank where;
otherwise the ranks meet at the job's store, check in, and form a Gloo (or
``cpu:gloo,cuda:nccl``) process group, on the interface on the route to the store; a
program's own ``init_process_group()`` afterwards uses that group (``torch_guard``).
A ring formed here hands the runtime the ring's view of the store and its prefix, so
that the host's shared-memory plane can sit in front of it (``ringcore.shm.layer``); an
adopted group has no store of ours and keeps the network path. torch is imported only
when a ring is formed.
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Any

from .. import _config as cfg
from .._errors import RendezvousError
from ..rendezvous import iface
from ..rendezvous.environment import Rendezvous
from ..rendezvous.iface import is_loopback
from ..rendezvous.store_server import host_store, hosted_store, start_store_server
from . import torch_guard
from .choice import plan
from .protocol import Connection

log = logging.getLogger("ringtrain.ringcore")

__all__ = ["connect"]


def connect(rdv: Rendezvous, requested: str | None = None) -> Connection:
    """Join (or adopt) the ring of ``rdv``'s job; the backend moves tensors through it.
    ``requested``: "gloo" or "nccl" as asked for, None to choose (``choice``)."""
    import torch.distributed as dist

    from .torch_backend import torch_backend

    torch_guard.install()
    if rdv.source == "mpi":
        rdv = _gloo_under_mpi(rdv)
    if dist.is_initialized():
        _check_adopted(dist, rdv)
        return Connection(torch_backend(), rdv)
    prefixed, prefix = _form_group(rdv, requested)
    try:
        backend = torch_backend()
    except BaseException:
        _destroy_group()
        raise
    return Connection(backend, rdv, store=prefixed, close=_destroy_group, prefix=prefix)


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


def _form_group(rdv: Rendezvous, requested: str | None) -> tuple[Any, str]:
    """Meet at the store, check in, and form the default process group (gloo, or
    cpu:gloo,cuda:nccl with this rank's GPU pinned: ``choice.plan``); returns the ring's
    view of the store (under this generation's prefix) and that prefix."""
    import torch.distributed as dist

    topo = rdv.topology
    start_timeout = _timeout(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
    # A store *named* by a hostname that resolves to loopback here only (rank 0's own
    # name in /etc/hosts) must not put a multi-host ring on lo; a literal 127.x is local.
    spans_hosts = topo.local_size < topo.size and not is_loopback(rdv.store_addr)
    chosen = iface.apply(rdv.store_addr, rdv.store_port, spans_hosts)
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
            timeout=cfg.group_timeout(),
        )
        torch_guard.set_ringcore_formed(True)
    except Exception as exc:
        raise RendezvousError(
            f"rank {topo.rank} of {topo.size} could not form the {backend} ring through "
            f"{rdv.store_addr}:{rdv.store_port} ({type(exc).__name__}: {exc}). This rank's "
            f"data plane is on interface {chosen.name or 'chosen by Gloo'} ({chosen.reason}): "
            f"if peers cannot reach it, set {cfg.IFACE_ENV_VAR} to the interface that "
            "reaches the other hosts, and let TCP between the hosts through (docs/cluster.md)."
        ) from exc
    return prefixed, prefix


def _rings_formed(store: Any, rank: int) -> int:
    """How many rings this rank has formed through this store, this one included: the
    prefix of the ring's keys. It is counted in the store, not in the process: the store
    lives as long as the job, so every rank of a job gets the same number whatever its
    process did before. A process-wide count gave a Python worker that Spark reused
    across jobs (each job with its own store) a number its peers did not have, and the
    ranks waited for each other under two prefixes until RING_START_TIMEOUT."""
    return int(store.add(f"ringcore/formed/{rank}", 1))


def _destroy_group() -> None:
    """Leave the process group this module formed (a dead peer must not make it fail)."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception as exc:
            log.debug("destroy_process_group failed: %s", exc)
    torch_guard.set_ringcore_formed(False)
    iface.restore()


def _open_store(rdv: Rendezvous, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    if rdv.topology.size == 1 and rdv.store_port == 0:
        return dist.HashStore()
    hosted = hosted_store(rdv.store_port)
    if hosted is not None:
        return hosted
    addr, port, size = rdv.store_addr, rdv.store_port, rdv.topology.size
    try:
        if rdv.is_store_host:  # kept past shutdown(): the next init() meets here (store_server)
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

    While an elastic ring re-forms (``rdv.superseded`` is set: see
    ``ringcore.elastic.worker.rejoin``), a rank also stops waiting once the launcher has
    published a newer generation: a rank that already moved to it never arrives here,
    so the wait could only end at the timeout; rejoin then joins the newest."""
    topo = rdv.topology
    if topo.size == 1:
        return
    keys = [f"arrived/{r}" for r in range(topo.size)]
    store.set(keys[topo.rank], "1")
    superseded = rdv.superseded
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        left = deadline - time.monotonic()
        step = min(left, _SUPERSEDED_POLL_S) if superseded else left
        try:
            store.wait(keys, datetime.timedelta(seconds=max(step, 0.001)))
            return
        except Exception:  # torch raises DistStoreError / RuntimeError on timeout
            missing = [r for r, key in enumerate(keys) if not store.check([key])]
        if not missing:
            return
        why = superseded() if superseded else None
        if why:
            raise RendezvousError(
                f"rank {topo.rank} of {topo.size}: {why} while ranks {missing} had not arrived"
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

    comm = MPI.COMM_WORLD
    single_host = rdv.topology.local_size == rdv.topology.size
    addr = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
    port = start_store_server(world_size=rdv.topology.size) if rdv.topology.rank == 0 else 0
    addr, port = comm.bcast((addr, port), root=0)
    return replace(rdv, store_addr=addr, store_port=port, source="mpi+gloo")
