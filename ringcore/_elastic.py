"""Elastic membership: generations of the ring published by a launcher that outlives
every rank (the parent of ``run_workers``, the Spark or Ray driver).

The launcher hosts the job's store and keeps, per generation ``g``:

- ``elastic/generation``: the current ``g``;
- ``elastic/world/<g>``: JSON ``{"workers": [worker ids in rank order], "hosts": [...]}``;
- ``elastic/reset/<g>``: a counter workers bump to ask for a new generation (after a
  collective failed, say) — the launcher answers with the workers still alive.

A worker leaves its ring (``shutdown``), asks for the next generation, waits for it,
takes its rank from its id's place in the member list, and calls ``init()`` again.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any

from . import _config as cfg
from ._errors import RingError, RingInternalError
from ._rendezvous import worker_env
from ._topology import topology_from_hosts

__all__ = ["ElasticDriver", "HostsUpdatedInterrupt", "generation", "is_elastic", "next_generation"]

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


def hosts_updated() -> bool:
    return is_elastic() and generation() > _my_generation


def next_generation() -> None:
    """Leave the current ring, wait for the launcher's next generation, and set the
    environment so that ``init()`` joins it with this worker's new rank."""
    from ._runtime import shutdown

    shutdown()
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
    global _my_generation
    me = os.environ[cfg.WORKER_ID_ENV_VAR]
    rank = world["workers"].index(me)
    env = worker_env(
        topology_from_hosts(world["hosts"], rank),
        os.environ[cfg.STORE_ADDR_ENV_VAR],
        int(os.environ[cfg.STORE_PORT_ENV_VAR]),
        external_store=True,
    )
    env[cfg.STORE_PREFIX_ENV_VAR] = f"elastic/ring/{g}"
    os.environ.update(env)
    _my_generation = g


class ElasticDriver:
    """The launcher's side: publishes a new generation whenever a worker dies or asks.

    ``alive()`` returns the ids of the live workers (in their preferred rank order) and
    their hosts; ``min_workers`` below which the job is aborted.
    """

    def __init__(self, store: Any, alive, min_workers: int = 1, grace_s: float = 0.5):
        self.store, self.alive, self.min_workers, self.grace_s = store, alive, min_workers, grace_s
        self.generation = 0
        self.members: list[str] = []

    def start(self, members: list[str]) -> None:
        self.members = list(members)
        self.store.add(GEN_KEY, 0)

    def grow(self, ids: list[str]) -> None:
        """Publish a generation with the workers ``ids`` added (already started; ``alive()``
        lists them). The running ranks learn of it at their next commit."""
        live_ids, live_hosts = self.alive()
        missing = [i for i in ids if i not in live_ids]
        if missing:
            raise RuntimeError(f"workers {missing} are not running")
        self._publish(live_ids, live_hosts)

    def publish(self, ids: list[str], hosts: list[str]) -> None:
        """Publish a generation of exactly these workers (a launcher that decides the
        members itself, e.g. the Spark driver forming the first ring)."""
        self._publish(ids, hosts)

    def abort(self, reason: str) -> None:
        """Publish a last generation that tells every waiting worker to stop with ``reason``."""
        self.generation += 1
        self.store.set(f"elastic/world/{self.generation}", json.dumps({"abort": reason}))
        self.store.add(GEN_KEY, 1)
        self.members = []

    def _publish(self, ids: list[str], hosts: list[str]) -> None:
        self.generation += 1
        world: dict[str, Any] = {"workers": ids, "hosts": hosts}
        if len(ids) < self.min_workers:
            world = {"abort": f"only {len(ids)} workers left, fewer than min_np={self.min_workers}"}
        self.store.set(f"elastic/world/{self.generation}", json.dumps(world))
        self.store.add(GEN_KEY, 1)
        self.members = list(ids)

    def poll(self) -> bool:
        """Check once; True when a new generation was published."""
        ids, hosts = self.alive()
        lost = [m for m in self.members if m not in ids]
        asked = int(self.store.add(f"elastic/reset/{self.generation}", 0)) > 0
        if not lost and not asked:
            return False
        time.sleep(self.grace_s)  # let every death of the same event show
        ids, hosts = self.alive()
        self._publish(ids, hosts)
        return True
