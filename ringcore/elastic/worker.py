"""A worker's side of elastic membership: generations of the ring published by a
launcher that outlives every rank (the parent of ``run_workers``, the Spark or Ray
driver; its side is ``driver``).

The launcher hosts the job's store and keeps, per generation ``g``:

- ``elastic/generation``: the current ``g``;
- ``elastic/world/<g>``: JSON ``{"workers": [worker ids in rank order], "hosts": [...]}``;
- ``elastic/reset/<g>``: a counter workers bump to ask for a new generation (after a
  collective failed, say) — the launcher answers with the workers still alive.

A worker leaves its ring (``shutdown``), asks for the next generation, waits for it,
takes its rank from its id's place in the member list, and calls ``init()`` again
(:func:`rejoin`, given both: this room sits below the runtime that owns them).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from .. import _config as cfg
from .._errors import RingError, RingInternalError
from ..rendezvous.environment import free_port, torchrun_env, worker_env
from ..rendezvous.topology import topology_from_hosts

log = logging.getLogger("ringtrain.ringcore.elastic")

__all__ = [
    "GEN_KEY",
    "HostsUpdatedInterrupt",
    "forget_job",
    "generation",
    "hosts_updated",
    "is_elastic",
    "join_late",
    "joined_generation",
    "leave",
    "left_key",
    "next_generation",
    "rejoin",
    "rejoining",
    "superseded",
]

GEN_KEY = "elastic/generation"


class HostsUpdatedInterrupt(RingError):
    """Raised at ``state.commit()`` when workers were added or removed: the elastic
    loop re-forms the ring and syncs the state (``skip_sync`` when nothing was lost)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of workers changed; re-forming the ring")
        self.skip_sync = skip_sync

    def __reduce__(self):
        return (type(self), (self.skip_sync,))


def is_elastic() -> bool:
    return os.environ.get(cfg.ELASTIC_ENV_VAR) == "1"


_client: Any = None
_my_generation = 0


def _store() -> Any:
    global _client
    if _client is None:
        import torch.distributed as dist

        _client = dist.TCPStore(
            os.environ[cfg.STORE_ADDR_ENV_VAR],
            int(os.environ[cfg.STORE_PORT_ENV_VAR]),
            is_master=False,
            timeout=datetime.timedelta(
                seconds=cfg.get_float(cfg.ELASTIC_TIMEOUT_ENV_VAR, cfg.DEFAULT_ELASTIC_TIMEOUT_S)
            ),
        )
    return _client


def generation() -> int:
    """The generation the launcher has published (0 before any change)."""
    return int(_store().add(GEN_KEY, 0))


def joined_generation() -> int:
    """The generation this worker last joined (0: the first ring, or not elastic)."""
    return _my_generation


_rejoining = False


def rejoining() -> bool:
    """True while :func:`rejoin` forms the next ring: every rank of it came through
    next_generation(), which takes the newest, so a peer may skip a generation that a
    newer one superseded (the first ring's members, and a late worker's first ring,
    come to theirs)."""
    return _rejoining


def hosts_updated() -> bool:
    return is_elastic() and generation() > _my_generation


def superseded() -> str | None:
    """Why the ring this worker is forming is moot (the launcher published a generation
    newer than the one it joined), or None. The runtime hands it to the rendezvous of a
    ring that :func:`rejoin` forms (``Rendezvous.superseded``)."""
    if hosts_updated():
        return f"generation {_my_generation} of the ring was superseded"
    return None


def next_generation() -> None:
    """Wait for the launcher's next generation (asking for one when none is newer than
    this worker's), and set the environment so that ``init()`` joins it with this
    worker's new rank. The worker has left its ring already (``shutdown()``)."""
    store = _store()
    if generation() <= _my_generation:
        store.add(f"elastic/reset/{_my_generation}", 1)
    deadline = time.monotonic() + cfg.get_float(
        cfg.ELASTIC_TIMEOUT_ENV_VAR, cfg.DEFAULT_ELASTIC_TIMEOUT_S
    )
    while (g := generation()) <= _my_generation:
        if time.monotonic() > deadline:
            raise RingInternalError(
                f"no new generation of the ring was published within {cfg.ELASTIC_TIMEOUT_ENV_VAR}"
            )
        time.sleep(0.05)
    world = json.loads(store.get(f"elastic/world/{g}"))
    me = os.environ[cfg.WORKER_ID_ENV_VAR]
    if world.get("abort"):
        raise RingError(world["abort"])
    if me not in world["workers"]:
        raise RingError(f"worker {me} is not part of generation {g} of the ring")
    _set_world(g, world)


def left_key(worker_id: str) -> str:
    """The store key a worker bumps when it stops for good (``leave``)."""
    return f"elastic/left/{worker_id}"


def leave() -> None:
    """This worker stops for good (its function raised): tell the launcher now, so the
    next ring is formed without it instead of waiting for it until the start timeout."""
    if not is_elastic():
        return
    try:
        _store().add(left_key(os.environ[cfg.WORKER_ID_ENV_VAR]), 1)
    except Exception as exc:  # the launcher notices the process exit anyway
        log.debug("could not tell the launcher this worker leaves: %s", exc)


def rejoin(init: Callable[[], None], shutdown: Callable[[], None]) -> None:
    """Leave the ring (``shutdown``) and join the next generation (``init``); when that
    ring cannot form (a member was lost while it formed — a partitioned host the
    launcher has not dropped yet), ask for another generation and try again, until
    ``RING_ELASTIC_TIMEOUT``. An abort published by the launcher is raised at once."""
    deadline = time.monotonic() + cfg.get_float(
        cfg.ELASTIC_TIMEOUT_ENV_VAR, cfg.DEFAULT_ELASTIC_TIMEOUT_S
    )
    global _rejoining
    while True:
        shutdown()
        next_generation()
        _rejoining = True
        try:
            init()
            return
        except (RingError, RuntimeError, OSError) as exc:  # not a bad setting (ValueError)
            if time.monotonic() > deadline:
                raise
            log.warning(
                "generation %d of the ring did not form (%s: %s); asking for the next one",
                _my_generation,
                type(exc).__name__,
                exc,
            )
        finally:
            _rejoining = False


def forget_job() -> None:
    """Drop this process's link to a finished elastic job (its store client and
    generation), so that a reused process (a Spark Python worker) can join another."""
    global _client, _my_generation
    _client, _my_generation = None, 0


def join_late() -> None:
    """A worker started after the job began: wait for the generation that lists it and
    set the environment so that ``init()`` joins that ring."""
    me = os.environ[cfg.WORKER_ID_ENV_VAR]
    deadline = time.monotonic() + cfg.get_float(
        cfg.ELASTIC_TIMEOUT_ENV_VAR, cfg.DEFAULT_ELASTIC_TIMEOUT_S
    )
    while True:
        g = generation()
        if g > 0:
            world = json.loads(_store().get(f"elastic/world/{g}"))
            if world.get("abort"):
                raise RingError(world["abort"])
            if me in world.get("workers", []):
                break
        if time.monotonic() > deadline:
            raise RingInternalError(f"worker {me} was never made part of the ring")
        time.sleep(0.05)
    _set_world(g, world)


def _set_world(g: int, world: dict) -> None:
    """This worker's environment in generation ``g``: the ``RING_*`` variables and
    torchrun's, with the new rank, world size and rank 0 (``_master_port``)."""
    global _my_generation
    me = os.environ[cfg.WORKER_ID_ENV_VAR]
    rank = world["workers"].index(me)
    topology = topology_from_hosts(world["hosts"], rank)
    env = worker_env(
        topology,
        os.environ[cfg.STORE_ADDR_ENV_VAR],
        int(os.environ[cfg.STORE_PORT_ENV_VAR]),
        external_store=True,
    )
    env[cfg.STORE_PREFIX_ENV_VAR] = f"elastic/ring/{g}"
    master = world["hosts"][0] or os.environ[cfg.STORE_ADDR_ENV_VAR]
    run_id = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ[cfg.STORE_PORT_ENV_VAR]
    port = _master_port(g, rank)
    if port is not None:
        env.update(torchrun_env(topology, master, port, run_id))
        env["TORCHELASTIC_RESTART_COUNT"] = str(g)
    os.environ.update(env)
    _my_generation = g


def _master_port(g: int, rank: int) -> int | None:
    """The ``MASTER_PORT`` of generation ``g``: rank 0 picks a port free on its host and
    publishes it in the store; the others read it (None when ``g`` is superseded first:
    that ring never forms, and ``rejoin`` moves on)."""
    key = f"elastic/master_port/{g}"
    if rank == 0:
        port = free_port()
        _store().set(key, str(port))
        return port
    deadline = time.monotonic() + cfg.get_float(
        cfg.ELASTIC_TIMEOUT_ENV_VAR, cfg.DEFAULT_ELASTIC_TIMEOUT_S
    )
    while time.monotonic() < deadline:
        if _store().check([key]):
            return int(_store().get(key))
        if generation() > g:
            return None
        time.sleep(0.02)
    return None
