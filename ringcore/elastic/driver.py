"""The launcher's side of elastic membership: :class:`ElasticDriver` publishes the
generations of the ring through the job's store by the one
:class:`~ringcore.elastic.policy.ElasticPolicy` every launcher shares; a launcher only
tells it who is alive and starts more workers when it asks. The keys it writes and the
worker's side that reads them: ``ringcore.elastic.worker``.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

from ..rendezvous.topology import host_major_order
from .policy import AliveFn, ElasticPolicy, StartMoreFn, Workers
from .worker import GEN_KEY, left_key

log = logging.getLogger("ringtrain.ringcore.elastic")

__all__ = ["ElasticDriver"]


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
        gone = {i for i in live.ids if int(self.store.add(left_key(i), 0)) > 0}
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
