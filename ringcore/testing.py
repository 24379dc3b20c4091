"""``run_workers(fn, np=2)``: run a function on ``np`` local ranks over Gloo on 127.0.0.1.

The parent process hosts the job's store (a coordinator that outlives every rank),
starts one process per rank (forked from a server with torch loaded: ``ringcore._ranks``)
with the rendezvous environment set (the ``RING_*`` variables, a fresh per-job
``RING_SECRET_KEY``, and torchrun's ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``PORT``...
so that a ``torch.distributed`` program runs as it is), and
returns each rank's result ordered by rank — or raises :class:`WorkerError` with
the first failing rank's traceback after ending the other ranks.
"""

from __future__ import annotations

import datetime
import time
import uuid
from multiprocessing.connection import wait
from typing import Any

import cloudpickle

from . import _config as cfg
from . import _ranks
from ._auth import new_secret
from ._errors import RingError, WorkerError
from .launch import (
    ElasticJob,
    ElasticNames,
    ElasticPolicy,
    Workers,
    check_elastic_limits,
    free_port,
    install_init_guard,
    late_worker_env,
    torchrun_env,
    worker_env,
)
from .rendezvous.topology import topology_from_hosts
from .runtime.lifecycle import shutdown

__all__ = ["run_workers"]

_LOOPBACK = "127.0.0.1"


def _child(payload: bytes, env: dict[str, str], conn: Any) -> None:
    # the process already runs with ``env`` (``_ranks.process`` set it up)
    rank = int(env[cfg.RANK_ENV_VAR])
    try:
        install_init_guard()
        fn, args, kwargs = cloudpickle.loads(payload)
        result = fn(*args, **kwargs)
        conn.send(("ok", cloudpickle.dumps(result)))
    except BaseException as exc:
        conn.send(
            (
                "error",
                cloudpickle.dumps(
                    WorkerError.from_exception(rank, env.get(cfg.HOSTNAME_ENV_VAR, _LOOPBACK), exc)
                ),
            )
        )
    finally:
        shutdown()
        conn.close()


def _end(procs: list[Any], grace_s: float = 3.0, exit_s: float = 0.0) -> None:
    """End ``procs``: wait ``exit_s`` for them to exit on their own (a rank that returned
    still runs ``shutdown()``, which writes its timeline), then terminate, then kill."""
    deadline = time.monotonic() + exit_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


class _Workers:
    """The spawned rank processes of one ``run_workers`` call, and their results."""

    def __init__(self, fn, args, kwargs, env, port: int, elastic: bool):
        self.ctx = _ranks.context()
        self.secret = new_secret()  # one per job; env= may override RING_SECRET_KEY
        self.payload = cloudpickle.dumps((fn, args, kwargs or {}))
        self.env, self.port, self.elastic = env or {}, port, elastic
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.hosts: list[str] = []
        self.results: dict[int, Any] = {}
        self.deadline = float("inf")  # when run_workers gives up on the ranks

    def spawn(self, rank_env: dict[str, str], host: str) -> int:
        r = len(self.procs)
        if self.elastic:
            rank_env.update({cfg.ELASTIC_ENV_VAR: "1", cfg.WORKER_ID_ENV_VAR: str(r)})
        rank_env.update(self.env)
        parent_conn, child_conn = self.ctx.Pipe(duplex=False)
        p = _ranks.process(
            self.ctx, _child, (self.payload, rank_env, child_conn), rank_env, f"ring-rank-{r}"
        )
        p.start()
        child_conn.close()
        self.procs.append(p)
        self.conns.append(parent_conn)
        self.hosts.append(host)
        return r

    def spawn_late(self, host: str) -> int:
        """A worker added to a running elastic job: it learns its rank from the next generation."""
        env = late_worker_env(_LOOPBACK, self.port, str(len(self.procs)), secret=self.secret)
        return self.spawn(env, host)

    def alive(self) -> Workers:
        """Workers still in the job: running, or done with a result (done is not lost)."""
        done = {r for r, v in self.results.items() if not isinstance(v, WorkerError)}
        live = [r for r, p in enumerate(self.procs) if p.is_alive() or r in done]
        return Workers(
            tuple(str(r) for r in live),
            tuple(self.hosts[r] for r in live),
            frozenset(str(r) for r in done),
        )

    def step(self, pending: dict, timeout: float, timeout_s: float, keep_errors: bool) -> None:
        """Wait up to ``timeout_s`` (until :attr:`deadline`, the end of the job's
        ``timeout``) for a rank in ``pending`` to end; collect every rank that did (the
        first error raised, unless ``keep_errors``)."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise RingError(
                f"run_workers timed out after {timeout:.0f} s; ranks {sorted(pending)} had not "
                "returned. Raise timeout= or look for a rank that waits on a collective the others skipped."
            )
        ready = wait(
            list(pending.values()) + [self.procs[r].sentinel for r in pending],
            timeout=min(left, timeout_s),
        )
        for r in list(pending):
            if pending[r] in ready or self.procs[r].sentinel in ready:
                kind, value = self.collect(r)
                del pending[r]
                if kind == "error" and not keep_errors:
                    raise value
                self.results[r] = value

    def collect(self, r: int) -> tuple[str, Any]:
        try:
            kind, data = self.conns[r].recv()
            return kind, cloudpickle.loads(data)
        except EOFError:
            self.procs[r].join(5.0)
            return "error", WorkerError(
                r,
                self.hosts[r],
                "ProcessExit",
                f"the process exited with code {self.procs[r].exitcode} before returning",
            )


TESTING_NAMES = ElasticNames(min="min_np")


def _elastic_job(store: Any, workers: _Workers, pending: dict, min_np: int, grow, step) -> Any:
    """The kit's elastic loop over these workers: ``grow=[(seconds, count)]`` is what this
    launcher answers when the driver asks it to start more (``count`` workers in one
    generation, once ``seconds`` have passed since the start); ``step(timeout_s)`` waits
    for the ranks and collects those that ended."""

    growth = sorted(grow or [])
    started = time.monotonic()

    def start_more() -> list[str]:
        if not growth or time.monotonic() - started < growth[0][0]:
            return []
        _, count = growth.pop(0)
        new = [workers.spawn_late(_LOOPBACK) for _ in range(count)]
        pending.update({r: workers.conns[r] for r in new})
        return [str(r) for r in new]

    job = ElasticJob(
        store,
        workers.alive,
        ElasticPolicy(min_workers=min_np),
        wait=step,
        finished=lambda: not pending,
        start_more=start_more,
        name="run_workers",
        poll_s=0.2,
    )
    job.start([str(r) for r in range(len(workers.procs))])
    return job


def run_workers(
    fn,
    np: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    hosts: list[str] | None = None,
    return_exceptions: bool = False,
    elastic: bool = False,
    min_np: int = 1,
    grow: list[tuple[float, int]] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the results by rank.

    ``hosts`` fakes the host of every rank (to test local/cross ranks); every process
    still runs on this machine and talks over 127.0.0.1. With ``return_exceptions``,
    a failed rank's :class:`WorkerError` takes its place in the list (as in
    ``asyncio.gather``) and the other ranks run on; otherwise the first failure ends
    every rank and is raised.

    With ``elastic``, this process is the job's elastic coordinator: when a rank dies
    (or the ranks ask for it), it publishes a new generation of the ring with the
    workers still alive, and ``ringcore.torch.elastic.run`` re-forms the ring on them;
    ``grow=[(seconds, count)]`` adds ``count`` workers that many seconds after the
    start. Results are indexed by worker (original rank, then added workers); a dead
    worker's entry is its :class:`WorkerError` (``return_exceptions`` is implied).
    """
    return_exceptions = return_exceptions or elastic
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    hosts = list(hosts) if hosts is not None else [_LOOPBACK] * np
    if len(hosts) != np:
        raise ValueError(f"hosts lists {len(hosts)} entries but np is {np}")
    if grow and not elastic:
        raise ValueError("grow= adds workers to an elastic job; pass elastic=True")
    if elastic:
        check_elastic_limits(min_np, names=TESTING_NAMES)
    import torch.distributed as dist

    store = dist.TCPStore(
        _LOOPBACK, 0, np, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    workers = _Workers(fn, args, kwargs, env, store.port, elastic)
    master_port, run_id = free_port(_LOOPBACK), uuid.uuid4().hex
    for r in range(np):
        topology = topology_from_hosts(hosts, r)
        rank_env = worker_env(
            topology, _LOOPBACK, store.port, external_store=True, secret=workers.secret
        )
        rank_env.update(torchrun_env(topology, _LOOPBACK, master_port, run_id))
        workers.spawn(rank_env, hosts[r])
    pending = dict(enumerate(workers.conns))
    workers.deadline = time.monotonic() + timeout

    def step(timeout_s: float) -> None:
        workers.step(pending, timeout, timeout_s, return_exceptions)

    finished = False
    try:
        if elastic:
            with _elastic_job(store, workers, pending, min_np, grow, step) as job:
                job.watch()
        while pending:
            step(1.0)
        finished = True
    finally:
        # every rank returned: give them time to shut down cleanly (timeline, store)
        _end(workers.procs, exit_s=10.0 if finished else 0.0)
        del store
    return [workers.results[r] for r in range(len(workers.procs))]
