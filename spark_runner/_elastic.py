"""``spark_runner.run_elastic``: a job that goes on when Spark tasks are lost or added.

A barrier stage is all-or-nothing, so an elastic job runs outside barrier mode: one
single-task Spark job per slot (``max_num_proc`` of them, submitted from driver
threads; :mod:`spark_runner._slot_jobs`), so that a lost task fails only its own job.
On a classic session these are RDD jobs under one job group; on a Spark Connect client
(no SparkContext) ``mapInArrow`` operations under one operation tag. Everything else is
the same on both: the driver (on Connect, the client) is the rendezvous coordinator: it
hosts the job's store and publishes the generations of the ring through the kit's
elastic loop (:class:`ringcore.launch.ElasticJob`, by its
:class:`~ringcore.launch.ElasticPolicy`). Each task connects to the driver's log server
with its worker id — that socket closing is how the driver learns at once that a worker
died — and joins the ring through the first generation that lists it. A task Spark
retries (``spark.task.maxFailures``) is a new worker and joins the next generation.
"""

from __future__ import annotations

import datetime
import logging
import queue
import sys
import time
import uuid
import warnings
from typing import Any

import cloudpickle

from ringcore.launch import (
    DEFAULT_ELASTIC_TIMEOUT_S,
    ElasticJob,
    ElasticNames,
    ElasticPolicy,
    LogServer,
    Workers,
    check_elastic_limits,
    dumps_with_user_code,
    find_worker_error,
    new_secret,
)

from ._elastic_task import ElasticTaskSpec, make_elastic_task
from ._run import (
    _active_session,
    _check_options,
    _plain_keyboard_interrupt,
    _say,
    driver_address,
    horovod_options_env,
    resolve_timeout,
)
from ._session import is_connect
from ._slot_jobs import ClassicSlotJobs, ConnectSlotJobs, SlotJobs
from ._slots import NotEnoughSlotsError, default_num_proc, wait_for_slots

log = logging.getLogger("ringtrain.spark_runner")

POLL_S = 0.1


SPARK_NAMES = ElasticNames(min="min_num_proc", max="max_num_proc", num="num_proc")


def _resolve_sizes(spark: Any, num_proc, min_num_proc, max_num_proc) -> tuple[int, int, int]:
    """``num_proc`` (default: ``max_num_proc``, else ``min_num_proc``, else the cluster's
    parallelism) and the bounds around it (default: ``num_proc``); checked before."""
    if num_proc is None:
        num_proc = max_num_proc or min_num_proc or default_num_proc(spark)
    min_n = min_num_proc if min_num_proc is not None else num_proc
    max_n = max_num_proc if max_num_proc is not None else num_proc
    return num_proc, min_n, max_n


class _Membership:
    """Which workers are in the job: what the ``ElasticDriver`` calls ``alive()``."""

    def __init__(self, server: LogServer):
        self.server = server
        self.job: ElasticJob | None = None

    def alive(self) -> Workers:
        """Members still connected or done, in rank order, then newly connected workers
        (the driver's policy admits those while no member has finished, up to
        ``max_num_proc``); ``done``: the workers that said they finished."""
        connected, finished = self.server.workers(), self.server.finished()
        members = self.job.driver.members if self.job is not None else []
        ids = [m for m in members if m in connected or m in finished]
        hosts = {**{m: "" for m in ids}, **connected}
        ids += [w for w in connected if w not in ids and w not in finished]
        return Workers(tuple(ids), tuple(hosts[i] for i in ids), frozenset(finished))


def run_elastic(
    fn,
    args: tuple = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    min_num_proc: int | None = None,
    max_num_proc: int | None = None,
    start_timeout: float | None = None,
    elastic_timeout: float | None = None,
    reset_limit: int | None = None,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    verbose: int = 1,
    prefix_output_with_timestamp: bool = False,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    extra_mpi_args: str | None = None,
    nics: Any = None,
    min_np: int | None = None,
    max_np: int | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` as an elastic job and return the return values of
    the workers of the final ring, ordered by rank.

    ``fn`` uses ``ringcore.torch.elastic`` (``TorchState`` / ``ObjectState``,
    ``ElasticSampler``, ``@elastic.run``). The first ring forms from ``num_proc``
    workers (default: ``max_num_proc``, else the cluster's parallelism) — or, after
    ``start_timeout`` (default 600 s, ``RING_SPARK_START_TIMEOUT``), from those that
    started if there are at least ``min_num_proc`` (default ``num_proc``). When a
    worker is lost the ring re-forms on the others; tasks that start later (one per
    slot up to ``max_num_proc``, default ``num_proc``, e.g. a task Spark retried) are
    added at the workers' next ``commit()``. Below ``min_num_proc`` the driver waits up
    to ``elastic_timeout`` (default 600 s) for workers to come back, then fails;
    ``reset_limit`` bounds the number of re-formations. Output options as in ``run``;
    a line's prefix is the worker's rank in its current ring (``[-]`` before it joined).
    Horovod's ``nics``, ``use_gloo``, ``use_mpi``, ``extra_mpi_args`` as in ``run``;
    ``min_np`` / ``max_np`` are Horovod's deprecated spellings of ``min_num_proc`` /
    ``max_num_proc``.

    On a Spark Connect session the same: each worker is a one-task ``mapInArrow`` job
    under an operation tag, and this client hosts the ring's store and log server, so
    the executors must reach it (see ``spark_runner._slot_jobs``).
    """
    _check_options(fn, env, verbose, None)
    env = horovod_options_env(env, use_gloo, use_mpi, extra_mpi_args, nics)
    min_num_proc = _deprecated_alias("min_np", min_np, "min_num_proc", min_num_proc)
    max_num_proc = _deprecated_alias("max_np", max_np, "max_num_proc", max_num_proc)
    check_elastic_limits(
        min_num_proc,
        max_num_proc,
        reset_limit,
        elastic_timeout,
        num=num_proc,
        min_required=False,
        names=SPARK_NAMES,
    )
    wait_s = DEFAULT_ELASTIC_TIMEOUT_S if elastic_timeout is None else float(elastic_timeout)
    spark = _active_session()
    num_proc, min_n, max_n = _resolve_sizes(spark, num_proc, min_num_proc, max_num_proc)
    timeout = resolve_timeout(start_timeout)
    slots = wait_for_slots(spark, min_n, timeout)  # classic or Connect
    _say(verbose, 2, "the cluster offers %d task slots for %d-%d workers", slots, min_n, max_n)
    payload = dumps_with_user_code((fn, tuple(args), dict(kwargs or {})), fn)
    job = _ElasticRun(spark, fn, num_proc, min_n, max_n, timeout, wait_s, reset_limit, verbose)
    return job.run(payload, env, stdout, stderr, prefix_output_with_timestamp)


def _deprecated_alias(old: str, old_value: Any, new: str, new_value: Any) -> Any:
    """Horovod's deprecated ``min_np`` / ``max_np``: accepted, with a DeprecationWarning."""
    if old_value is None:
        return new_value
    if new_value is not None and new_value != old_value:
        raise ValueError(f"{old}={old_value!r} and {new}={new_value!r} disagree; pass only {new}")
    warnings.warn(f"{old} is deprecated, use {new} instead", DeprecationWarning, stacklevel=3)
    return old_value


class _ElasticRun:
    """The driver's side of one elastic job: its Spark jobs, log server and store around
    the kit's loop (``ElasticJob``), and the workers' results."""

    def __init__(self, spark, fn, num_proc, min_n, max_n, timeout, wait_s, reset_limit, verbose):
        self.spark, self.name = spark, getattr(fn, "__name__", "fn")
        self.num_proc, self.min_n, self.max_n = num_proc, min_n, max_n
        self.timeout, self.wait_s = timeout, wait_s
        self.reset_limit, self.verbose = reset_limit, verbose
        self.results: dict[str, Any] = {}

    def run(self, payload, env, stdout, stderr, timestamps) -> list[Any]:
        import torch.distributed as dist

        host, bind = driver_address(self.spark)  # on Connect: this client's address
        server = LogServer(
            stdout if stdout is not None else sys.stdout,
            stderr if stderr is not None else sys.stderr,
            bind_host=bind,
            advertised_host=host,
        )
        self.server = server  # where a failed task sends its error
        store = dist.TCPStore(
            host,
            0,
            1,
            True,
            timeout=datetime.timedelta(seconds=self.wait_s),
            wait_for_workers=False,
        )
        spec = ElasticTaskSpec(
            driver_host=host,
            store_port=int(store.port),
            log_port=server.port,
            secret=server.secret,
            env=dict(env or {}),
            timestamps=bool(timestamps),
            wait_s=self.wait_s + self.timeout,
            reset_limit=self.reset_limit or 0,
            ring_secret=new_secret(),  # one per job, never the fallback over Gloo
        )
        jobs = self._slot_jobs(make_elastic_task(payload, spec))
        members = _Membership(server)
        job = ElasticJob(
            store,
            members.alive,
            self._policy(),
            wait=lambda timeout_s: self._take(jobs, timeout_s),
            finished=lambda: self._finished(job),
            name=f"run_elastic of {self.name}",
            poll_s=POLL_S,
            on_generation=lambda g, n: _say(
                self.verbose, 2, "generation %d of the ring: %d workers", g, n
            ),
        )
        members.job = job
        _say(
            self.verbose,
            1,
            "launching %s elastically on up to %d Spark tasks",
            self.name,
            self.max_n,
        )
        started = time.monotonic()
        try:
            with _plain_keyboard_interrupt(), job:
                jobs.start(range(self.max_n))
                job.form(self.num_proc, self.timeout, self._too_few)
                order = job.watch()
        finally:
            jobs.cancel()  # ends the tasks still waiting to join
            server.close(drain_s=2.0)
            del store
        _say(
            self.verbose,
            1,
            "%s finished on %d workers in %.1f s (%d generations of the ring)",
            self.name,
            len(order),
            time.monotonic() - started,
            job.driver.generation,
        )
        return [self.results[w] for w in order]

    def _slot_jobs(self, task: Any) -> SlotJobs:
        """The slots' Spark jobs: RDD jobs under a job group, or on a Connect client
        ``mapInArrow`` operations under an operation tag."""
        label = f"ringtrain-elastic-{uuid.uuid4().hex[:12]}"
        if is_connect(self.spark):
            return ConnectSlotJobs(self.spark, label, task)
        description = (
            f"ringtrain spark_runner.run_elastic of {self.name} on {self.min_n}-{self.max_n} tasks"
        )
        return ClassicSlotJobs(self.spark.sparkContext, label, description, task)

    def _failure(self, outcome: Any) -> None:
        """Raise a worker's own error (its function raised); a lost task just leaves."""
        err = find_worker_error(str(outcome), self.server, self.server.secret, peers=False)
        if err is not None and err.error_type != "RingInternalError":
            raise err from None
        log.info("an elastic task ended without a result: %s", str(outcome).splitlines()[0][:200])

    def _take(self, jobs: SlotJobs, timeout_s: float) -> None:
        """Wait up to ``timeout_s`` for the slots' Spark jobs to end; take in every outcome."""
        block = True
        while True:
            try:
                _, kind, value = jobs.outcomes.get(block, timeout_s if block else None)
            except queue.Empty:
                return
            block = False
            if kind == "ok":
                worker_id, result = cloudpickle.loads(value)
                self.results[worker_id] = result
            else:
                self._failure(value)

    def _finished(self, job: ElasticJob) -> bool:
        """Every member of the ring returned its result."""
        members = job.driver.members
        return bool(members) and all(m in self.results for m in members)

    def _policy(self) -> ElasticPolicy:
        """Below ``min_num_proc`` wait ``elastic_timeout`` for workers to come back."""
        return ElasticPolicy(
            min_workers=self.min_n,
            max_workers=self.max_n,
            reset_limit=self.reset_limit,
            below_min_wait_s=self.wait_s,
            min_name="min_num_proc",
        )

    def _too_few(self, count: int) -> Exception:
        return NotEnoughSlotsError(
            f"run_elastic needs at least min_num_proc={self.min_n} tasks but only "
            f"{count} started within start_timeout={self.timeout:.0f} s. Lower "
            "min_num_proc, free or add task slots, or raise start_timeout."
        )
