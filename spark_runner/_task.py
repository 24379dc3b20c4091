"""What runs inside each Spark task of the barrier stage.

The attempt number (``RING_SPARK_ATTEMPT``) orders checkpoint writers, ``(fit,
attempt)`` in ``ringcore.runs.checkpoints``: a retried stage's tasks must count as newer than
a zombie of the attempt before, never equal. The driver's log server hands out the
stage attempt (Spark's own on a classic session, counted from connections on Spark
Connect), and the ranks take the largest any of them got, so they agree. PySpark tells
a task no stage attempt: ``attemptNumber()`` starts again at 0 in every stage attempt
(measured on ``local[2,2]``), so it would make a retry equal its zombie. When no rank
of an attempt reached the log server, the attempt is 0 if Spark cannot retry the stage
(it runs once), else :func:`agreed_attempt`'s negative number, below every number the
driver hands out and growing from one attempt to the next.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

import ringcore
from ringcore import (
    RingInternalError,
    WorkerError,
    start_store_server,
    topology_from_hosts,
    worker_env,
)
from ringcore.launch import (
    HOSTNAME_ENV_VAR,
    STORE_ADDR_ENV_VAR,
    STORE_PORT_ENV_VAR,
    LogConnection,
    connect_log,
    free_port,
    host_major_order,
    install_init_guard,
    release_user_group,
    stop_store_server,
    stream_pair,
    task_failure_text,
    torchrun_env,
)

ATTEMPT_ENV_VAR = "RING_SPARK_ATTEMPT"
GPU_ADDRESSES_ENV_VAR = "RING_GPU_ADDRESSES"
SECONDARY_FAILURE_DELAY_S = 2.0
#: what :func:`agreed_attempt` subtracts from a task attempt id to number an attempt
#: that could not ask the driver: below 0, as Spark's task ids stay below 2**62
UNKNOWN_ATTEMPT_BASE = 1 << 62


@dataclass(frozen=True)
class TaskSpec:
    """Plain data every task gets (pickled with the task, never logged)."""

    num_proc: int
    env: dict[str, str]
    log_host: str
    log_port: int
    secret: str = field(repr=False)  # the log server's; never in the task's environment
    ring_secret: str = field(
        default="", repr=False
    )  # RING_SECRET_KEY of the ring's control channel
    timestamps: bool = False
    use_gpu: bool | None = None
    topology_hosts: tuple[str, ...] = ()  # seam: fake hosts per rank, for local/cross ranks
    # Spark reruns the stage on a failure (a cluster manager's retries): a task finishes
    # only once every task has, so none of them succeeds beside a failed peer.
    all_or_none: bool = False
    run_id: str = ""  # TORCHELASTIC_RUN_ID: this (the application id) and the stage id


def gpu_env(ctx: Any, use_gpu: bool | None, local_rank: int) -> dict[str, str]:
    """``CUDA_VISIBLE_DEVICES``: the GPUs Spark gave this task, else the local rank's
    (counted within the executor's own ``CUDA_VISIBLE_DEVICES`` when it has one, as a
    container limited to some GPUs does)."""
    if use_gpu is False:
        return {}
    gpus = ctx.resources().get("gpu")
    if gpus is not None and gpus.addresses:
        addresses = ",".join(gpus.addresses)
    elif use_gpu:
        own = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        own = [d for d in own if d]
        addresses = own[local_rank % len(own)] if own else str(local_rank)
    else:
        return {}
    return {"CUDA_VISIBLE_DEVICES": addresses, GPU_ADDRESSES_ENV_VAR: addresses}


def _host_major_rank(ctx: Any, spec: TaskSpec, slot: int) -> tuple[int, list[str]]:
    """This task's rank and every slot's address (from the stage's task infos, which
    every task has: no ``allGather``, each of which Spark answers after a whole second
    at least, its barrier RPC being polled once a second). Ranks are host-major: the
    tasks of one host get consecutive ranks, whatever order Spark gave the partitions."""
    hosts = [str(info.address).rsplit(":", 1)[0] for info in ctx.getTaskInfos()]
    return host_major_order(list(spec.topology_hosts or hosts)).index(slot), hosts


def agreed_attempt(attempts: list[int | None], task_ids: list[int], retried: bool) -> int:
    """The stage attempt every rank of one attempt uses. ``attempts``: what each rank's
    log server handed out (None: it could not connect); ``task_ids``: each rank's Spark
    task attempt id; ``retried``: whether Spark may rerun the stage.

    The largest handed-out number (Spark Connect's count can lag on one rank). With none
    and no retries, 0: the stage runs once. With none under retries, the smallest task
    id less UNKNOWN_ATTEMPT_BASE: never equal to another attempt's number, as Spark
    numbers tasks in launch order across the application and launches a stage
    attempt's tasks only after the one before failed (so a later such attempt is
    larger), and negative, below every handed-out number (so beside an attempt that
    could ask, it is the older writer: at worst it stops as stale, it never
    overwrites)."""
    known = [a for a in attempts if a is not None]
    if known:
        return max(known)
    return min(task_ids) - UNKNOWN_ATTEMPT_BASE if retried else 0


def _ring_env(
    ctx: Any, spec: TaskSpec, rank: int, hosts: list[str], conn: LogConnection | None
) -> dict[str, str]:
    placed = list(spec.topology_hosts or hosts)
    order = host_major_order(placed)  # order[rank] = the slot (partition) of that rank
    port = start_store_server(world_size=spec.num_proc) if rank == 0 else 0
    master_port = free_port() if rank == 0 else 0  # the user's own group's (torchrun's)
    mine = [port, conn.stage_attempt if conn is not None else None, ctx.taskAttemptId()]
    gathered = [json.loads(g) for g in ctx.allGather(json.dumps([*mine, master_port]))]
    ports = [int(g[0]) for g in gathered]
    attempt = agreed_attempt([g[1] for g in gathered], [g[2] for g in gathered], spec.all_or_none)
    topology = topology_from_hosts([placed[s] for s in order], rank)
    store = order[0]
    env = worker_env(topology, hosts[store], ports[store], secret=spec.ring_secret or None)
    run_id = f"{spec.run_id or 'spark'}-stage-{ctx.stageId()}"
    env.update(torchrun_env(topology, hosts[store], int(gathered[store][3]), run_id))
    env[HOSTNAME_ENV_VAR] = hosts[
        order[rank]
    ]  # the address peers reach, whatever the topology says
    env[ATTEMPT_ENV_VAR] = str(attempt)
    env.update(gpu_env(ctx, spec.use_gpu, topology.local_rank))
    env.update(spec.env)
    return env


@contextlib.contextmanager
def _task_environment(ctx: Any, spec: TaskSpec, rank: int, hosts: list[str]):
    """Yields the task's log-server connection (None: it could not connect)."""
    saved_env = dict(os.environ)
    saved_out, saved_err = sys.stdout, sys.stderr
    conn = connect_log(spec.log_host, spec.log_port, spec.secret, ctx.stageId())
    out, err = stream_pair(conn, rank, spec.timestamps)
    try:
        os.environ.update(_ring_env(ctx, spec, rank, hosts, conn))
        sys.stdout, sys.stderr = out, err
        install_init_guard()  # the user's init_process_group forms or joins the job's group
        yield conn
    finally:
        out.close()
        err.close()
        sys.stdout, sys.stderr = saved_out, saved_err
        if conn is not None:
            conn.close()
        ringcore.shutdown()
        release_user_group()  # Spark reuses Python workers: leave nothing behind
        stop_store_server()
        os.environ.clear()
        os.environ.update(saved_env)


#: the job store's keys of :func:`finish_together` (the store is this attempt's own)
_ARRIVED, _GO = "ringtrain/finish/arrived", "ringtrain/finish/go"
_LEFT, _ALL_LEFT = "ringtrain/finish/left", "ringtrain/finish/all-left"
#: how long a task waits in :func:`finish_together` for its peers to finish their
#: function: as long as Spark's own barrier would (a peer may train for days longer;
#: a failed one gets this task killed by Spark)
_FINISH_WAIT = datetime.timedelta(days=365)
#: ... and how long it tries to reach the store (up when rank 0 is: it serves it)
_FINISH_CONNECT = datetime.timedelta(seconds=60)


def finish_together(rank: int, size: int) -> None:
    """Return once every rank of this attempt has returned from its function: a barrier
    through the attempt's store (rank 0's, ``RING_STORE_ADDR``), which answers within a
    round trip, where ``BarrierTaskContext.barrier()`` takes a second at least (Spark
    polls its barrier RPC once a second).

    Each rank counts itself in; the last one in says go; each rank that saw go counts
    itself out, the last one out says so, and rank 0, whose process serves the store,
    returns only then, so no rank waits on a store that is gone. The store lost before go means rank
    0 failed (or its host is unreachable): this task then fails too, after
    ``SECONDARY_FAILURE_DELAY_S`` so that rank 0's failure is the one the driver
    reports, and Spark reruns the whole stage, as it does when it kills this task for a
    failed peer. Lost after go, it is of no concern: every rank arrived."""
    import torch.distributed as dist

    try:
        store = dist.TCPStore(
            os.environ[STORE_ADDR_ENV_VAR],
            int(os.environ[STORE_PORT_ENV_VAR]),
            size,
            False,
            timeout=_FINISH_CONNECT,
            wait_for_workers=False,
        )
        store.set_timeout(_FINISH_WAIT)
        if store.add(_ARRIVED, 1) == size:
            store.set(_GO, "1")
        store.wait([_GO])
    except Exception as exc:  # any loss of the store fails the task alike
        time.sleep(SECONDARY_FAILURE_DELAY_S)
        raise RuntimeError(
            f"rank {rank} returned, but lost the job's store (rank 0's) while it waited for "
            f"the other ranks to return ({type(exc).__name__}: {exc}); rank 0 failed or "
            "became unreachable, and Spark reruns the stage"
        ) from None
    with contextlib.suppress(Exception):
        if store.add(_LEFT, 1) == size:
            store.set(_ALL_LEFT, "1")
        if rank == 0:
            store.wait([_ALL_LEFT])


def make_barrier_task(payload: bytes, spec: TaskSpec):
    """The function given to ``RDD.barrier().mapPartitions``."""

    def task(_: Iterator[Any]) -> Iterator[bytes]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        slot = ctx.partitionId()
        rank, hosts = _host_major_rank(ctx, spec, slot)
        host = hosts[slot]
        with _task_environment(ctx, spec, rank, hosts) as conn:
            try:
                fn, args, kwargs = cloudpickle.loads(payload)
                result = fn(*args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, RingInternalError):
                    # A broken ring is usually the echo of another rank's failure: let that
                    # root cause fail the stage first, so it is the one the driver reports.
                    time.sleep(SECONDARY_FAILURE_DELAY_S)
                err = WorkerError.from_exception(rank, host, exc)
                raise RuntimeError(task_failure_text(err, spec.secret, conn)) from None
            if spec.all_or_none:
                # A retried barrier stage reruns only the partitions with no output: a task
                # that succeeded just after a peer failed would leave the rerun one task
                # short, its first allGather waiting for ever. Wait here until every task
                # has done; when a peer fails instead, Spark kills this task and reruns
                # them all.
                finish_together(rank, spec.num_proc)
        yield cloudpickle.dumps((rank, result))

    return task
