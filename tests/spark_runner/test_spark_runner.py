"""spark_runner.run on real Spark: local[2] and local-cluster[2,1,1024]."""

from __future__ import annotations

import pytest

import spark_runner
from ringcore import RingError, WorkerError

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module", params=["local[2]", "local-cluster[2,1,1024]"])
def spark(request):
    session = spark_runner.local_session(request.param, app_name="test_spark_runner")
    try:
        yield session
    finally:
        session.stop()


def _describe(offset, scale=1):
    import os

    import torch

    import ringcore.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + offset)]), op=hvd.Sum).item()
    return {
        "rank": hvd.rank(),
        "size": hvd.size(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "sum": total * scale,
        "pid": os.getpid(),
        "env": os.environ.get("MY_SETTING"),
        "attempt": os.environ.get(spark_runner.ATTEMPT_ENV_VAR),
    }


def test_run_returns_every_ranks_result_ordered_by_rank(spark):
    results = spark_runner.run(
        _describe, args=(1,), kwargs={"scale": 10}, num_proc=2, env={"MY_SETTING": "on"}
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 for r in results)
    assert [r["sum"] for r in results] == [30.0, 30.0]  # (1 + 2) * 10
    assert len({r["pid"] for r in results}) == 2  # two worker processes
    assert all(r["env"] == "on" and r["attempt"] == "0" for r in results)


def test_ranks_on_one_host_get_local_ranks(spark):
    results = spark_runner.run(_describe, args=(0,), num_proc=2)
    assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 2), (1, 2)]


def test_num_proc_defaults_to_the_cluster_parallelism(spark):
    results = spark_runner.run(_describe, args=(0,))
    assert len(results) == spark.sparkContext.defaultParallelism == 2


def _fails_on_rank_one():
    import ringcore.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("label column vanished")
    hvd.barrier()


def test_worker_exception_reaches_the_driver_with_rank_host_and_traceback(spark):
    with pytest.raises(WorkerError) as info:
        spark_runner.run(_fails_on_rank_one, num_proc=2)
    err = info.value
    assert err.rank == 1 and err.error_type == "KeyError"
    assert err.host == "127.0.0.1"
    assert "label column vanished" in str(err) and "_fails_on_rank_one" in err.traceback


def test_more_processes_than_slots_fails_before_any_job_starts(spark):
    tracker = spark.sparkContext.statusTracker()
    before = len(tracker.getJobIdsForGroup(None)) if hasattr(tracker, "getJobIdsForGroup") else None
    with pytest.raises(
        spark_runner.NotEnoughSlotsError, match="needs 3 task slots but the cluster has 2"
    ):
        spark_runner.run(_describe, args=(0,), num_proc=3, start_timeout=1)
    if before is not None:
        assert len(tracker.getJobIdsForGroup(None)) == before


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_proc": 0}, "num_proc must be a positive integer, got 0"),
        ({"num_proc": 2, "start_timeout": -1}, "start_timeout must be > 0"),
        ({"num_proc": 2, "env": {"A": 1}}, "env must map str to str"),
    ],
)
def test_bad_arguments_are_rejected_with_the_value_and_fix(spark, kwargs, message):
    with pytest.raises((ValueError, TypeError), match=message):
        spark_runner.run(_describe, args=(0,), **kwargs)


def test_run_without_a_session_says_how_to_make_one(spark):
    from pyspark.sql import SparkSession

    active = SparkSession.getActiveSession()
    assert active is not None
    try:
        SparkSession._activeSession = None  # what a fresh process has
        SparkSession._instantiatedSession = None
        active._jvm.SparkSession.clearActiveSession()
        with pytest.raises(RingError, match="needs an active SparkSession"):
            spark_runner.run(_describe, args=(0,), num_proc=2)
    finally:
        SparkSession._activeSession = active
        SparkSession._instantiatedSession = active
        active._jvm.SparkSession.setActiveSession(active._jsparkSession)


@pytest.mark.timeout(180)
def test_a_ring_after_a_one_rank_job_forms_on_the_python_workers_spark_reused(spark):
    """Spark reuses Python workers across jobs: after a one-rank job, one worker has
    formed one more ring than its peer. The next two-rank job must still form. It did
    not when the ring's keys were prefixed by a count of rings kept per process: the
    ranks waited for each other under two prefixes until RING_START_TIMEOUT."""
    (alone,) = spark_runner.run(_describe, args=(0,), num_proc=1, verbose=0)
    ring = spark_runner.run(
        _describe, args=(1,), num_proc=2, env={"RING_START_TIMEOUT": "30"}, verbose=0
    )
    assert [r["sum"] for r in ring] == [3.0, 3.0] and alone["sum"] == 0.0
    assert alone["pid"] in {r["pid"] for r in ring}  # a rank ran on the reused worker
