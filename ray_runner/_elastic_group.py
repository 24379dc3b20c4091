"""The worker group of an elastic ``RingTrainer`` run: ``ScalingConfig(num_workers=(min, max))``.

The driver is the launcher of ringcore's elastic protocol (``ringcore.launch``): it
hosts the job's store (a ``torch.distributed.TCPStore`` in the driver process, which
outlives every worker) and runs the kit's loop, :class:`ringcore.launch.ElasticJob`,
which publishes *generations* of the ring's members by its
:class:`~ringcore.launch.ElasticPolicy` (when the ring re-forms and grows); this group
only tells it who is alive, starts one more worker when asked, and waits on the actors. Each worker is one Ray actor with a stable id
(``RING_WORKER_ID``), placed on its own (no placement group, so workers can come and go
one at a time).

- Start: ``max`` actors are asked for; the run begins once ``min`` of them are up (and
  the others had a moment); actors Ray cannot place yet stay *pending*.
- A worker lost (its actor died, its node went away): the survivors' collectives fail
  with ``RingInternalError``, ``ringcore.torch.elastic.run`` restores their last commit
  and asks for a new generation; the driver confirms who is alive (a ping on each
  actor's control thread) and publishes the survivors. Fewer than ``min`` left: the
  generation says abort, and the attempt fails (``FailureConfig`` decides on a restart).
- Resources back: a pending actor gets placed, the driver starts it as a late worker
  and publishes a generation that adds it; the running ranks hear of it at their next
  ``state.commit()`` and the new rank gets the state from rank 0.

Every member of the first ring also gets torchrun's variables (``RANK``, ``WORLD_SIZE``,
..., ``MASTER_ADDR`` = the first member's node, ``MASTER_PORT`` = a port that member's
actor found free there); ringcore sets them again for every later generation, so a
``torch.distributed`` program sees the ranks of the ring it runs in.

The driver must be reachable from the workers (not a Ray Client driver).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from ringcore import Topology, WorkerError, topology_from_hosts, worker_env
from ringcore.launch import (
    ELASTIC_ENV_VAR,
    HOSTNAME_ENV_VAR,
    WORKER_ID_ENV_VAR,
    ElasticJob,
    ElasticPolicy,
    Workers,
    get_float,
    late_worker_env,
    new_secret,
    torchrun_env,
)

from . import _constants as const
from ._config import ScalingConfig
from ._session import SessionSetup
from ._worker import CONTROL_GROUP, RingWorker

log = logging.getLogger("ringtrain.ray_runner")

__all__ = ["ElasticGroup"]

# After min workers are up, how long the others get to come up too (seconds).
_START_GRACE_S = 2.0


@dataclass
class _Member:
    actor: Any
    host: str
    node_id: str
    ref: Any = None  # the running loop's ObjectRef
    done: bool = False


class ElasticGroup:
    """Start, watch, shrink and grow the workers of one elastic attempt."""

    worker_cls: type = RingWorker

    def __init__(self, scaling: ScalingConfig):
        self.scaling = scaling
        self.timeout_s = get_float(
            const.PLACEMENT_GROUP_TIMEOUT_ENV_VAR, const.DEFAULT_PLACEMENT_GROUP_TIMEOUT_S
        )
        self.ping_timeout_s = get_float(const.PING_TIMEOUT_ENV_VAR, const.DEFAULT_PING_TIMEOUT_S)
        self._ids = itertools.count()
        self.members: dict[str, _Member] = {}  # in rank order of the latest generation
        self.pending: dict[str, tuple[Any, Any]] = {}  # id -> (actor, its node() ref)
        self._actor_cls: Any = None
        self._store: Any = None
        self._store_addr = ""
        # one per job: authenticates the engine's control connections of every generation
        self._secret = new_secret()
        self._run_id = uuid.uuid4().hex  # torchrun's TORCHELASTIC_RUN_ID, for every generation
        self._master: tuple[str, int] = ("", 0)  # MASTER_ADDR/PORT of the first ring

    # -- the attempt ---------------------------------------------------------------

    def run(
        self,
        loop: Callable,
        setup: SessionSetup,
        on_reports: Callable[[list[dict]], None],
        poll_s: float,
    ) -> list[WorkerError]:
        """Run the loop on the group until every member is done; [] or the failed ranks' errors."""
        self._error: WorkerError | None = None
        try:
            self._open_store()
            self._start_initial()
            self._master = self._pick_master()
            job = ElasticJob(
                self._store,
                self._alive,
                self._policy(),
                wait=lambda timeout_s: self._wait(on_reports, timeout_s),
                finished=lambda: self._error is not None or self._all_done(),
                start_more=lambda: self._start_one_more(loop, setup),
                recheck=self._confirm_alive,
                name="the elastic group",
                poll_s=poll_s,
                stop_raises=False,  # the workers read the abort and fail the attempt
            )
            with job:
                job.start(list(self.members))
                for rank, (wid, member) in enumerate(self.members.items()):
                    env = self._env(wid, member, rank)
                    topology = topology_from_hosts([m.node_id for m in self.members.values()], rank)
                    self._launch(member, loop, setup, topology, env)
                job.watch()
            return [self._error] if self._error is not None else []
        finally:
            self._shutdown()

    def _all_done(self) -> bool:
        return all(m.done for m in self.members.values())

    def _wait(self, on_reports: Callable[[list[dict]], None], timeout_s: float) -> None:
        """Collect the members' loops that return within ``timeout_s``, then their reports."""
        running = {m.ref: wid for wid, m in self.members.items() if not m.done}
        if running:
            ready, _ = ray.wait(list(running), num_returns=len(running), timeout=timeout_s)
            for ref in ready:
                self._error = self._finish(running[ref], ref)
                if self._error is not None:
                    break
        self._drain(on_reports)

    def _finish(self, wid: str, ref: Any) -> WorkerError | None:
        """A member's loop returned: done, lost (its actor died), or failed (its error)."""
        member = self.members[wid]
        rank = list(self.members).index(wid)
        try:
            kind, value = ray.get(ref)
        except ray.exceptions.RayActorError as exc:
            log.info("elastic worker %s on %s was lost: %s", wid, member.host, exc)
            del self.members[wid]
            return None
        except ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None) or exc
            return WorkerError(rank, member.host, type(cause).__name__, str(cause), str(exc))
        if kind == "error":
            return value
        member.done = True
        return None

    def _policy(self) -> ElasticPolicy:
        """The elastic policy of this group (a seam: ElasticRayExecutor bounds resets)."""
        return ElasticPolicy(
            min_workers=self.scaling.min_workers,
            max_workers=self.scaling.max_workers,
            min_name="min_workers",
        )

    # -- membership ----------------------------------------------------------------

    def _alive(self) -> Workers:
        """For the ElasticDriver: the members still in the job (running or done), in rank order."""
        return Workers(
            tuple(self.members),
            tuple(m.host for m in self.members.values()),
            frozenset(wid for wid, m in self.members.items() if m.done),
        )

    def _confirm_alive(self) -> None:
        """The ranks asked for a new ring: drop every member whose actor does not answer."""
        pings = {m.actor.ping.remote(): wid for wid, m in self.members.items() if not m.done}
        ready, silent = ray.wait(list(pings), num_returns=len(pings), timeout=self.ping_timeout_s)
        dead = [pings[ref] for ref in silent]
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayError:
                dead.append(pings[ref])
        for wid in dead:
            member = self.members.pop(wid)
            log.info("elastic worker %s on %s does not answer; dropping it", wid, member.host)
            _kill(member.actor)

    def _start_one_more(self, loop: Callable, setup: SessionSetup) -> list[str]:
        """For the ElasticDriver, below max workers: start a pending actor that Ray placed
        meanwhile as a late worker (``[its id]``); else keep one actor pending (``[]``)."""
        for wid, (actor, node_ref) in list(self.pending.items()):
            ready, _ = ray.wait([node_ref], timeout=0)
            if not ready:
                continue
            del self.pending[wid]
            try:
                host, node_id = ray.get(node_ref)
            except ray.exceptions.RayError:
                continue
            member = _Member(actor, host, node_id)
            self.members[wid] = member
            self._launch(
                member, loop, setup, topology_from_hosts([host], 0), self._late_env(wid, host)
            )
            log.info("elastic worker %s on %s joins the ring", wid, host)
            return [wid]
        if not self.pending:
            self._ask_for_worker()
        return []

    # -- actors --------------------------------------------------------------------

    def _open_store(self) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(
            "0.0.0.0",
            0,
            1,
            True,
            timeout=datetime.timedelta(seconds=self.timeout_s),
            wait_for_workers=False,
        )
        self._store_addr = ray.util.get_node_ip_address()

    def _ask_for_worker(self) -> str:
        if self._actor_cls is None:
            # Ray's stubs miss the concurrency_groups overload.
            self._actor_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(self.worker_cls)  # type: ignore[call-overload]
        sc = self.scaling
        options: dict[str, Any] = {"num_cpus": sc.cpus_per_worker}
        if sc.gpus_per_worker:
            options["num_gpus"] = sc.gpus_per_worker
        if sc.extra_resources:
            options["resources"] = sc.extra_resources
        actor = self._actor_cls.options(**options).remote()
        wid = str(next(self._ids))
        self.pending[wid] = (actor, actor.node.remote())
        return wid

    def _start_initial(self) -> None:
        """Ask for max workers; go on with those up once min are (after a short grace)."""
        from ._errors import PlacementGroupTimeoutError

        for _ in range(self.scaling.max_workers):
            self._ask_for_worker()
        refs = {ref: wid for wid, (_, ref) in self.pending.items()}
        low = self.scaling.min_workers
        ready, rest = ray.wait(list(refs), num_returns=low, timeout=self.timeout_s)
        if len(ready) < low:
            raise PlacementGroupTimeoutError(
                f"only {len(ready)} of the minimum {low} elastic workers started within "
                f"{self.timeout_s:g} s; each needs {self.scaling.resources_per_worker or {'CPU': 1}} "
                f"and the cluster has {ray.available_resources()} free. Lower num_workers' min, add "
                f"nodes, or raise ${const.PLACEMENT_GROUP_TIMEOUT_ENV_VAR}."
            )
        if rest:
            more, _ = ray.wait(rest, num_returns=len(rest), timeout=_START_GRACE_S)
            ready += more
        up = []
        for ref in ready:
            wid = refs[ref]
            actor, _ = self.pending.pop(wid)
            host, node_id = ray.get(ref)
            up.append((wid, _Member(actor, host, node_id)))
        # The driver's node first (rank 0 beside the store), ranks of a node contiguous.
        here = ray.get_runtime_context().get_node_id()
        order = {n: i for i, n in reversed(list(enumerate(m.node_id for _, m in up)))}
        up.sort(key=lambda item: (item[1].node_id != here, order[item[1].node_id], int(item[0])))
        self.members = dict(up)

    def _pick_master(self) -> tuple[str, int]:
        """``MASTER_ADDR``/``MASTER_PORT`` of the first ring: rank 0's node, and a port
        its actor found free there."""
        rank0 = next(iter(self.members.values()))
        kind, value = ray.get(rank0.actor.master_port.remote())
        if kind == "error":
            raise value
        return rank0.host, int(value)

    def _env(self, wid: str, member: _Member, rank: int) -> dict[str, str]:
        topology = topology_from_hosts([m.node_id for m in self.members.values()], rank)
        env = worker_env(
            topology,
            self._store_addr,
            int(self._store.port),
            external_store=True,
            secret=self._secret,
        )
        env.update(torchrun_env(topology, *self._master, self._run_id))
        env[HOSTNAME_ENV_VAR] = member.host
        env[ELASTIC_ENV_VAR] = "1"
        env[WORKER_ID_ENV_VAR] = wid
        return env

    def _late_env(self, wid: str, host: str) -> dict[str, str]:
        """A worker added to the running ring: ``init()`` waits for the generation listing it."""
        env = late_worker_env(
            self._store_addr, int(self._store.port), wid, secret=self._secret, host=host
        )
        env["TORCHELASTIC_RUN_ID"] = self._run_id  # ringcore sets the rest when it joins
        return env

    def _launch(
        self,
        member: _Member,
        loop: Callable,
        setup: SessionSetup,
        topology: Topology,
        env: dict[str, str],
    ) -> None:
        member.actor.setup.remote(topology, env)  # actor calls run in order
        member.ref = member.actor.run_loop.remote(loop, setup)

    def _drain(self, on_reports: Callable[[list[dict]], None]) -> None:
        """Collect every member's queued reports (only the current rank 0 queues any)."""
        refs = [m.actor.drain_reports.remote() for m in self.members.values()]
        for ref in refs:
            try:
                on_reports(ray.get(ref, timeout=self.ping_timeout_s))
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.debug("could not collect an elastic worker's reports: %s", exc)

    def _shutdown(self) -> None:
        for member in self.members.values():
            _kill(member.actor)
        for actor, _ in self.pending.values():
            _kill(actor)
        self.members, self.pending = {}, {}
        self._store = None


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already dead, or Ray shut down first
        log.debug("could not kill an elastic worker: %s", exc)
