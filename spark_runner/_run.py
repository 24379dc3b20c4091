"""``spark_runner.run``: a function on ``num_proc`` tasks of one Spark barrier stage."""

from __future__ import annotations

import logging
import uuid
from typing import Any

import cloudpickle

from ringcore import RingError
from ringcore._config import get_float
from ringcore._pickling import dumps_with_user_code

from ._errors import decode_worker_error
from ._slots import wait_for_slots
from ._task import make_barrier_task

log = logging.getLogger("ringtrain.spark_runner")

START_TIMEOUT_ENV_VAR = "RING_SPARK_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 600.0


def _active_session():
    from pyspark.sql import SparkSession

    spark = SparkSession.getActiveSession()
    if spark is None:
        raise RingError(
            "spark_runner.run needs an active SparkSession; create one first, e.g. "
            "spark_runner.local_session() or SparkSession.builder.getOrCreate()."
        )
    return spark


def run(
    fn,
    args: tuple = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one Spark task each, and
    return every rank's return value ordered by rank.

    Inside ``fn``, ``ringcore.init()`` (or ``hvd.init()``) joins the ring with no other
    setting. A worker's exception is raised here as :class:`ringcore.WorkerError`
    carrying its rank, host and traceback.
    """
    if not callable(fn):
        raise TypeError(f"run takes a callable as fn, got {type(fn).__name__}")
    if env is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TypeError("env must map str to str, e.g. {'OMP_NUM_THREADS': '1'}")
    spark = _active_session()
    sc = spark.sparkContext
    if num_proc is None:
        num_proc = sc.defaultParallelism
    if not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc must be a positive integer, got {num_proc!r}")
    timeout = (
        start_timeout
        if start_timeout is not None
        else get_float(START_TIMEOUT_ENV_VAR, DEFAULT_START_TIMEOUT_S)
    )
    if timeout <= 0:
        raise ValueError(f"start_timeout must be > 0 seconds, got {timeout}")
    wait_for_slots(sc, num_proc, timeout)
    payload = dumps_with_user_code((fn, tuple(args), dict(kwargs or {})), fn)
    group = f"ringtrain-{uuid.uuid4().hex[:12]}"
    sc.setJobGroup(
        group,
        f"ringtrain spark_runner.run of {getattr(fn, '__name__', 'fn')} on {num_proc} tasks",
        interruptOnCancel=True,
    )
    try:
        rdd = sc.parallelize(range(num_proc), num_proc).barrier()
        blobs = rdd.mapPartitions(make_barrier_task(payload, dict(env or {}), num_proc)).collect()
    except KeyboardInterrupt:
        sc.cancelJobGroup(group)
        raise
    except Exception as exc:
        worker_error = decode_worker_error(str(exc))
        if worker_error is not None:
            raise worker_error from None
        raise RingError(f"the Spark barrier stage of {num_proc} tasks failed: {exc}") from exc
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)
    results = dict(cloudpickle.loads(b) for b in blobs)
    return [results[r] for r in range(num_proc)]
