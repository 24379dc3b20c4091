"""Elastic membership: generations of the ring published by a launcher that outlives
every rank (the parent of ``run_workers``, the Spark or Ray driver).

The launcher hosts the job's store and keeps, per generation ``g``:

- ``elastic/generation``: the current ``g``;
- ``elastic/world/<g>``: JSON ``{"workers": [worker ids in rank order], "hosts": [...]}``;
- ``elastic/reset/<g>``: a counter workers bump to ask for a new generation (after a
  collective failed, say) — the launcher answers with the workers still alive.

A worker leaves its ring (``shutdown``), asks for the next generation, waits for it,
takes its rank from its id's place in the member list, and calls ``init()`` again.

On the launcher's side, :class:`ElasticDriver` publishes the generations by the one
:class:`~ringcore._elastic_policy.ElasticPolicy` every launcher shares; a launcher
only tells it who is alive and starts more workers when it asks.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from . import _config as cfg
from ._elastic_policy import AliveFn, ElasticPolicy, StartMoreFn, Workers
from ._errors import RingError, RingInternalError
from ._rendezvous import worker_env
from ._topology import host_major_order, topology_from_hosts

log = logging.getLogger("ringtrain.ringcore.elastic")

__all__ = [
    "ElasticDriver",
    "HostsUpdatedInterrupt",
    "forget_job",
    "generation",
    "is_elastic",
    "join_late",
    "next_generation",
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


def _left_key(worker_id: str) -> str:
    return f"elastic/left/{worker_id}"


def leave() -> None:
    """This worker stops for good (its function raised): tell the launcher now, so the
    next ring is formed without it instead of waiting for it until the start timeout."""
    if not is_elastic():
        return
    try:
        _store().add(_left_key(os.environ[cfg.WORKER_ID_ENV_VAR]), 1)
    except Exception as exc:  # the launcher notices the process exit anyway
        log.debug("could not tell the launcher this worker leaves: %s", exc)


def rejoin(init: Callable[[], None]) -> None:
    """Leave the ring and join the next generation; when that ring cannot form (a
    member was lost while it formed — a partitioned host the launcher has not dropped
    yet), ask for another generation and try again, until ``RING_ELASTIC_TIMEOUT``.
    An abort published by the launcher is raised at once."""
    deadline = time.monotonic() + cfg.get_float(
        cfg.ELASTIC_TIMEOUT_ENV_VAR, cfg.DEFAULT_ELASTIC_TIMEOUT_S
    )
    global _rejoining
    while True:
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
    """The launcher's side: applies an :class:`ElasticPolicy` and publishes its generations.

    The launcher supplies *who is alive* (``alive()``: ``(ids, hosts)`` or a
    :class:`Workers`) and, to grow, *start one more* (``start_more()``: the ids of the
    workers it started now, or ``[]``); ``recheck()``, when given, is called when the
    ranks ask for a new ring, for a launcher that cannot see a hung worker cheaply (Ray
    pings its actors). The launcher's watch loop calls :meth:`poll` and reads
    :attr:`stopped` — the reason, once the policy gave the job up (an abort is
    published). ``policy`` or its fields as keywords (``min_workers=2``).
    """

    def __init__(
        self,
        store: Any,
        alive: AliveFn,
        policy: ElasticPolicy | None = None,
        *,
        start_more: StartMoreFn | None = None,
        recheck: Callable[[], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        **rules: Any,
    ):
        if policy is not None and rules:
            raise TypeError(f"pass policy= or its fields {sorted(rules)}, not both")
        self.store, self.alive = store, alive
        self.policy = policy if policy is not None else ElasticPolicy(**rules)
        self.start_more, self.recheck = start_more, recheck
        self.clock, self.sleep = clock, sleep
        self.generation = 0
        self.members: list[str] = []
        self.stopped: str | None = None  # why the policy gave the job up
        self._first: int | None = None  # the generation of the first ring
        self._below_since: float | None = None

    def start(self, members: list[str]) -> None:
        """Begin at generation 0: ``members`` (launched with their ranks) are the first
        ring; ``[]`` when the first :meth:`publish` forms it."""
        self.members = list(members)
        self._first = 0 if members else None
        self.store.add(GEN_KEY, 0)

    def workers(self) -> Workers:
        """Who is alive, as the policy admits them into a ring."""
        return self.policy.admit(self._alive(), self.members)

    def asked(self) -> bool:
        """True when a rank asked for a new generation of the current ring."""
        return int(self.store.add(f"elastic/reset/{self.generation}", 0)) > 0

    def grow(self, ids: list[str]) -> None:
        """Publish a generation with the workers ``ids`` added (already started; ``alive()``
        lists them). The running ranks learn of it at their next commit."""
        live = self.workers()
        missing = [i for i in ids if i not in live.ids]
        if missing:
            raise RuntimeError(f"workers {missing} are not running")
        self._publish(list(live.ids), list(live.hosts))

    def publish(self, ids: list[str], hosts: list[str]) -> None:
        """Publish a generation of exactly these workers (a launcher that decides the
        members itself, e.g. the Spark driver forming the first ring)."""
        self._publish(ids, hosts)

    def abort(self, reason: str) -> None:
        """Publish a last generation that tells every waiting worker to stop with ``reason``."""
        self._put({"abort": reason})
        self.members = []

    def _alive(self) -> Workers:
        """Who the launcher sees alive, less the workers that said they are leaving (a
        worker whose function raised: its process may still be exiting)."""
        live = Workers.of(self.alive())
        gone = {i for i in live.ids if int(self.store.add(_left_key(i), 0)) > 0}
        return live.only(lambda i: i not in gone) if gone else live

    def poll(self) -> bool:
        """Look once: re-form the ring after a change (a member lost, a worker that can
        join, the ranks' request), give up by the policy, grow; True when published."""
        if self.stopped:
            return False
        asked = self.asked()
        if asked and self.recheck is not None:
            self.recheck()
        live = self.workers()
        if self._waiting_below_min(len(live.ids)):
            return False
        published = False
        if self.policy.changed(live, self.members, asked):
            self.sleep(self.policy.grace_s)  # let every change of the same event show
            live = self.workers()
            if self.policy.may_publish(len(live.ids)):
                self._publish(list(live.ids), list(live.hosts))
                published = True
        return self._grow() or published

    def _waiting_below_min(self, count: int) -> bool:
        """Below ``min_workers`` with a policy that waits: start or go on waiting, and
        stop the job once the wait is over. False when there is nothing to wait for."""
        if not self.policy.waits_below_min:
            return False
        if count >= self.policy.min_workers:
            self._below_since = None
            return False
        if self._below_since is None:
            self._below_since = self.clock()
        reason = self.policy.give_up_below_min(count, self.clock() - self._below_since)
        if reason is not None:
            self._stop(reason)
        return True

    def _grow(self) -> bool:
        """Ask the launcher for more workers while the policy allows it; add each batch."""
        grown = False
        while self.start_more is not None and not self.stopped:
            if not self.policy.may_grow(self._alive(), self.members):
                break
            new = self.start_more()
            if not new:
                break
            self.grow(new)
            grown = True
        return grown

    def _stop(self, reason: str) -> None:
        self.stopped = reason
        self.abort(reason)

    def _publish(self, ids: list[str], hosts: list[str]) -> None:
        if self.stopped:
            return
        if self._first is not None:
            reason = self.policy.over_reset_limit(self.generation + 1 - self._first)
            if reason is not None:
                self._stop(reason)
                return
        # Host-major ranks (Horovod's numbering: a ring in rank order crosses each host
        # boundary once). Hosts in order of first appearance and workers of a host in
        # the launcher's order, so the first member (rank 0, whose state the others
        # sync from) keeps rank 0.
        order = host_major_order(hosts)
        ids, hosts = [ids[i] for i in order], [hosts[i] for i in order]
        world: dict[str, Any] = {"workers": ids, "hosts": hosts}
        short = self.policy.short_ring(len(ids))
        if short is not None:
            world = {"abort": short}
        self._put(world)
        self.members = list(ids)
        if self._first is None:
            self._first = self.generation

    def _put(self, world: dict[str, Any]) -> None:
        """Publish ``world`` as the next generation, and log it (a stop as a warning)."""
        self.generation += 1
        self.store.set(f"elastic/world/{self.generation}", json.dumps(world))
        self.store.add(GEN_KEY, 1)
        if "abort" in world:
            log.warning("elastic: generation %d stops the job: %s", self.generation, world["abort"])
        else:
            log.info(
                "elastic: generation %d of the ring: %d workers %s on hosts %s",
                self.generation,
                len(world["workers"]),
                world["workers"],
                sorted(set(world["hosts"])),
            )
