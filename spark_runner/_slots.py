"""How many barrier tasks the cluster can hold at once, and waiting for them; whether it
retries failed tasks.

A classic session counts its slots through the SparkContext. A Spark Connect client
holds no SparkContext: it reads ``spark.master`` and ``spark.task.cpus`` from
``spark.conf`` (a ``local[N]`` or ``local-cluster`` master), else one small probe job
counts the cluster's default parallelism.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from ringcore import RingError

from ._session import is_connect

log = logging.getLogger("ringtrain.spark_runner")

# Spark's own master patterns (SparkMasterRegex): "local", "local[N]" / "local[*]", and
# "local[N,F]"; every other master (local-cluster, spark://, yarn, k8s://, mesos://) runs
# a cluster scheduler.
_LOCAL = re.compile(r"^local(?:\[\s*(?:[0-9]+|\*)\s*(?:,\s*([0-9]+)\s*)?\])?$")
#: ``spark.task.maxFailures`` when unset on a cluster scheduler (Spark's default)
DEFAULT_CLUSTER_MAX_FAILURES = 4
#: seconds between two probes of a Connect server's cluster while executors register
PROBE_INTERVAL_S = 2.0
_LOCAL_N = re.compile(r"^local\[(\d+)(?:,\s*\d+)?\]$")
_LOCAL_CLUSTER = re.compile(r"^local-cluster\[\s*(\d+)\s*,\s*(\d+)\s*,\s*\d+\s*\]$")


class NotEnoughSlotsError(RingError, ValueError):
    pass


def task_max_failures(master: str, max_failures: str | None) -> int:
    """How many times Spark tries a task before failing its job, as Spark decides it:
    ``local`` and ``local[N]`` try once whatever ``spark.task.maxFailures`` says,
    ``local[N,F]`` F times; on any other master it is ``spark.task.maxFailures``
    (``max_failures``, None when unset), default 4."""
    match = _LOCAL.match(master.strip())
    if match:
        return int(match.group(1) or "1")
    if max_failures is None or not str(max_failures).strip():
        return DEFAULT_CLUSTER_MAX_FAILURES
    return int(max_failures)


def retries_configured(master: str, max_failures: str | None) -> bool:
    """Whether Spark retries failed tasks here (:func:`task_max_failures` > 1): on a
    cluster manager it does by default. Spark retries a barrier stage only when it is
    not the job's final stage, so then the results go through a shuffle."""
    return task_max_failures(master, max_failures) > 1


def _conf(sc: Any, key: str, default: str) -> str:
    return sc.getConf().get(key, default)


def task_slots(sc: Any, profile: Any = None) -> int:
    """Task slots Spark can run at once for ``profile`` (a pyspark ``ResourceProfile``
    Spark has taken, e.g. a ``StagePlan``'s: 2 executors of 1 GPU each hold 2 tasks of
    gpu=1), by default for the default resource profile."""
    jsc = sc._jsc.sc()
    java = getattr(profile, "_java_resource_profile", None)
    if java is None:
        java = jsc.resourceProfileManager().defaultResourceProfile()
    return int(jsc.maxNumConcurrentTasks(java))


def describe_cluster(sc: Any) -> str:
    executors = max(int(sc._jsc.sc().getExecutorMemoryStatus().size()) - 1, 0)  # minus the driver
    cores = _conf(sc, "spark.executor.cores", "?")
    task_cpus = _conf(sc, "spark.task.cpus", "1")
    if sc.master.startswith("local"):
        return f"master {sc.master}, spark.task.cpus={task_cpus}"
    return f"{executors} executors x spark.executor.cores={cores}, spark.task.cpus={task_cpus}"


def default_num_proc(spark: Any) -> int:
    """How many ranks ``run`` starts when ``num_proc`` is None: a classic session's
    ``sparkContext.defaultParallelism``; on a Spark Connect session (no SparkContext) the
    task slots of the server's cluster (read from ``spark.conf`` for a ``local[N]`` or
    ``local-cluster`` master, else one small probe job)."""
    if is_connect(spark):
        return connect_task_slots(spark)[0]
    return int(getattr(spark, "sparkContext", spark).defaultParallelism)


def wait_for_slots(sc: Any, num_proc: int, timeout_s: float, plan: Any = None) -> int:
    """Return the slot count once it reaches ``num_proc``; raise before any job starts
    when it cannot. Local masters have a fixed count; cluster masters get up to
    ``timeout_s`` for executors to register.

    ``sc``: a SparkContext, or a SparkSession (classic, or Spark Connect: the slots of
    the server's cluster, :func:`wait_for_connect_slots`, which counts CPU slots only).
    ``plan``: the stage's ``StagePlan`` (``spark_runner._resources``); its profile's slots
    are counted, and the error names what each task asks for."""
    if is_connect(sc):
        return wait_for_connect_slots(sc, num_proc, timeout_s)
    sc = getattr(sc, "sparkContext", sc)  # a classic SparkSession: its SparkContext
    dynamic = _conf(sc, "spark.dynamicAllocation.enabled", "false").lower() == "true"
    profile = getattr(plan, "profile", None)
    slots = task_slots(sc, profile)
    if slots >= num_proc:
        return slots
    fixed = sc.master.startswith("local") and not sc.master.startswith("local-cluster")
    deadline = time.monotonic() + (0.0 if fixed else timeout_s)
    if not fixed:
        log.info("waiting up to %.0f s for %d task slots (have %d)", timeout_s, num_proc, slots)
    while slots < num_proc and time.monotonic() < deadline:
        time.sleep(0.5)
        slots = task_slots(sc, profile)
    if slots >= num_proc:
        return slots
    hint = (
        " Dynamic allocation is on: set spark.dynamicAllocation.minExecutors high enough, since a "
        "barrier stage needs all its slots at once."
        if dynamic
        else ""
    )
    per_task = f" for tasks of {plan.describe_request()}" if profile is not None else ""
    raise NotEnoughSlotsError(
        f"The barrier stage needs {num_proc} task slots{per_task} but the cluster has {slots} "
        f"({describe_cluster(sc)}). Lower num_proc to {max(slots, 1)} or add executors/cores."
        f"{hint}"
    )


def _connect_conf(spark: Any, key: str, default: str) -> str:
    value = spark.conf.get(key, None)
    return default if value is None else str(value)


def _probe_parallelism(spark: Any) -> int:
    """The cluster's default parallelism: the partitions of a ``spark.range`` without a
    partition count (one small job)."""
    from pyspark.sql import functions as F

    row = spark.range(0, 1 << 16).select(F.max(F.spark_partition_id()).alias("p")).first()
    return int(row["p"]) + 1


def connect_task_slots(spark: Any) -> tuple[int, bool]:
    """Task slots a Spark Connect server's cluster offers, and whether that count is fixed
    (a local master) rather than growing as executors register."""
    master = _connect_conf(spark, "spark.master", "")
    task_cpus = max(int(_connect_conf(spark, "spark.task.cpus", "1")), 1)
    local = _LOCAL_N.match(master)
    if local:
        return int(local.group(1)) // task_cpus, True
    if master == "local":
        return 1 // task_cpus, True
    cluster = _LOCAL_CLUSTER.match(master)
    if cluster:
        return int(cluster.group(1)) * int(cluster.group(2)) // task_cpus, True
    return _probe_parallelism(spark) // task_cpus, master.startswith("local")


def wait_for_connect_slots(spark: Any, num_proc: int, timeout_s: float) -> int:
    """:func:`wait_for_slots` from what a Spark Connect client can see; raises before the
    barrier stage when the cluster cannot hold ``num_proc`` tasks at once."""
    slots, fixed = connect_task_slots(spark)
    deadline = time.monotonic() + (0.0 if fixed else timeout_s)
    while slots < num_proc and time.monotonic() < deadline:
        time.sleep(PROBE_INTERVAL_S)
        slots = connect_task_slots(spark)[0]
    if slots >= num_proc:
        return slots
    master = _connect_conf(spark, "spark.master", "?")
    task_cpus = _connect_conf(spark, "spark.task.cpus", "1")
    hint = (
        " Dynamic allocation is on: set spark.dynamicAllocation.minExecutors high enough, since a "
        "barrier stage needs all its slots at once."
        if _connect_conf(spark, "spark.dynamicAllocation.enabled", "false").lower() == "true"
        else ""
    )
    raise NotEnoughSlotsError(
        f"The barrier stage needs {num_proc} task slots but the Spark Connect server's cluster "
        f"has {slots} (master {master}, spark.task.cpus={task_cpus}). Lower num_proc to "
        f"{max(slots, 1)} or add executors/cores.{hint}"
    )
