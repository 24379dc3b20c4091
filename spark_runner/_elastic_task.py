"""What runs inside each (non-barrier) Spark task of ``run_elastic``: an RDD partition
function over the partition ``[slot]`` (on Spark Connect wrapped for ``mapInArrow`` by
``_connect.arrow_task``).

The task connects to the driver's log server naming its worker id (the socket is how
the driver learns that the worker's process died), sets the elastic environment so
that ``ringcore.init()`` waits for the driver's generation that lists it, runs the
function, says it is done and returns ``(worker id, result)``. A failed worker's error
goes to the driver on that connection (``ringcore.launch.task_failure_text``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

import ringcore
from ringcore import RingError, RingInternalError, WorkerError, launch
from ringcore.launch import LogConnection, late_worker_env, stream_pair, task_failure_text

from ._task import SECONDARY_FAILURE_DELAY_S, gpu_env


@dataclass(frozen=True)
class ElasticTaskSpec:
    """Plain data every elastic task gets (pickled with the task, never logged)."""

    driver_host: str
    store_port: int
    log_port: int
    secret: str = field(repr=False)  # the log server's: task connections, error blobs
    env: dict[str, str] = field(default_factory=dict)
    timestamps: bool = False
    wait_s: float = 600.0  # how long a worker waits for a generation that lists it
    reset_limit: int = 0
    ring_secret: str = field(default="", repr=False)  # the engine's control connections


def _rank_label() -> str:
    """The rank for output prefixes: ``-`` until the worker joined a ring."""
    joined = os.environ.get(launch.ELASTIC_LATE_ENV_VAR) == "0"
    return os.environ.get(launch.RANK_ENV_VAR, "-") if joined else "-"


def _elastic_env(spec: ElasticTaskSpec, worker_id: str, host: str, ctx: Any) -> dict[str, str]:
    # every worker joins through a generation the driver publishes
    env = late_worker_env(
        spec.driver_host, spec.store_port, worker_id, secret=spec.ring_secret, host=host
    )
    env[launch.ELASTIC_TIMEOUT_ENV_VAR] = str(spec.wait_s)
    env[launch.RESET_LIMIT_ENV_VAR] = str(spec.reset_limit)
    env.update(gpu_env(ctx, None, 0))  # only GPUs Spark assigned: local ranks change
    env.update(spec.env)
    return env


@contextlib.contextmanager
def _worker_environment(ctx: Any, spec: ElasticTaskSpec, worker_id: str):
    saved_env = dict(os.environ)
    saved_out, saved_err = sys.stdout, sys.stderr
    try:
        conn = LogConnection(spec.driver_host, spec.log_port, spec.secret, ctx.stageId(), worker_id)
    except (OSError, ValueError) as exc:
        raise RingError(
            f"run_elastic: this task cannot reach the driver at {spec.driver_host}:"
            f"{spec.log_port} ({exc}); elastic jobs need executors that can connect to the "
            "driver (set spark.driver.host to an address they reach; on Spark Connect, the "
            "client that called run_elastic: run it where the executors reach it)."
        ) from exc
    out, err = stream_pair(conn, _rank_label, spec.timestamps)
    try:
        os.environ.update(_elastic_env(spec, worker_id, conn.local_address, ctx))
        sys.stdout, sys.stderr = out, err
        launch.install_init_guard()  # one process group per generation, whoever forms it
        yield conn
    finally:
        out.close()
        err.close()
        sys.stdout, sys.stderr = saved_out, saved_err
        ringcore.shutdown()
        launch.release_user_group()  # Spark reuses Python workers: leave nothing behind
        launch.forget_job()
        conn.close()
        os.environ.clear()
        os.environ.update(saved_env)


def make_elastic_task(payload: bytes, spec: ElasticTaskSpec):
    """The function given to ``mapPartitions`` of one slot's one-task job."""

    def task(slots: Iterator[int]) -> Iterator[bytes]:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        assert ctx is not None, "run inside a Spark task"
        slot = next(iter(slots))
        worker_id = f"{slot}-{ctx.taskAttemptId()}"  # unique: a retried task is a new worker
        with _worker_environment(ctx, spec, worker_id) as conn:
            try:
                fn, args, kwargs = cloudpickle.loads(payload)
                result = fn(*args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, RingInternalError):
                    time.sleep(SECONDARY_FAILURE_DELAY_S)  # let the root cause arrive first
                rank = int(os.environ.get(launch.RANK_ENV_VAR, "0"))
                err = WorkerError.from_exception(rank, conn.local_address, exc)
                raise RuntimeError(task_failure_text(err, spec.secret, conn)) from None
            blob = cloudpickle.dumps((worker_id, result))
            conn.done()
        yield blob

    return task
