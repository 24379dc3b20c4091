"""Whether Spark retries a failed barrier stage: as its master and
``spark.task.maxFailures`` decide, read the way Spark reads them."""

from __future__ import annotations

import pytest

from spark_runner._slots import retries_configured, task_max_failures


@pytest.mark.parametrize(
    ("master", "max_failures", "tries"),
    [
        ("local", None, 1),
        ("local[2]", None, 1),
        ("local[*]", "4", 1),  # local[N] ignores spark.task.maxFailures
        ("local[4,3]", None, 3),
        ("local[2, 1]", "5", 1),
        ("local-cluster[2,1,1024]", None, 4),
        ("spark://master:7077", None, 4),
        ("yarn", None, 4),
        ("k8s://https://10.0.0.1:6443", None, 4),
        ("yarn", "1", 1),
        ("spark://master:7077", "2", 2),
    ],
)
def test_spark_retries_as_its_master_and_max_failures_decide(master, max_failures, tries):
    assert task_max_failures(master, max_failures) == tries
    assert retries_configured(master, max_failures) is (tries > 1)


_RETRY_SCRIPT = """
import json, os, sys
import spark_runner

def fails_on_the_first_attempt_only():
    attempt = int(os.environ[spark_runner.ATTEMPT_ENV_VAR])
    if attempt == 0 and os.environ["RING_RANK"] == "0":
        raise RuntimeError("a transient failure on the first attempt")
    return attempt

spark = spark_runner.local_session(
    "local-cluster[2,1,1024]",
    app_name="test_audit_fixes_retry",
    conf={"spark.executor.cores": "1", "spark.stage.maxConsecutiveAttempts": "2"},
)
spark.sparkContext.setLogLevel("ERROR")
unset = spark.sparkContext.getConf().get("spark.task.maxFailures") is None
try:
    results = spark_runner.run(fails_on_the_first_attempt_only, num_proc=2)
finally:
    spark.stop()
print("RESULT " + json.dumps({"unset": unset, "results": results}))
"""


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.reliability(
    fault="a task of a barrier stage fails on a cluster manager (Spark's default retries)",
    category="fault",
)
def test_on_a_cluster_master_an_unset_max_failures_still_retries_the_stage(tmp_path, request):
    """local-cluster runs Spark's cluster scheduler, where an unset spark.task.maxFailures
    is 4: the failed barrier stage reruns. Its own process: one SparkContext per process.
    Rank 1 returns at once while rank 0 fails: without the all-or-none finish of the task
    (TaskSpec.all_or_none) rank 1's late success kept its output, Spark reran rank 0's
    partition alone and its first allGather waited for ever (the hang CI saw)."""
    import json
    import subprocess
    import sys

    from _reliability import record

    script = tmp_path / "retry.py"
    script.write_text(_RETRY_SCRIPT)
    proc = subprocess.run(
        # ~90 s alone; local-cluster's two executor JVMs start slowly on a loaded machine
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    assert got == {"unset": True, "results": [1, 1]}  # both ranks ran again, as attempt 1
    record(request, note="spark.task.maxFailures unset; the retried stage ran as attempt 1")


# ---- the all-or-none finish, through the attempt's store -------------------------------


@pytest.fixture
def job_store(monkeypatch):
    """The attempt's store as rank 0's process serves it, on loopback; the task's
    environment names it, as ``_ring_env`` does."""
    import datetime

    import torch.distributed as dist

    server = dist.TCPStore(
        "127.0.0.1", 0, 3, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False
    )
    monkeypatch.setenv("RING_STORE_ADDR", "127.0.0.1")
    monkeypatch.setenv("RING_STORE_PORT", str(server.port))
    return [server]


def test_finish_together_returns_on_every_rank_only_once_the_last_rank_returned(job_store):
    """What replaced ``BarrierTaskContext.barrier()`` (a second at least) under retries:
    no rank's task may succeed before every rank's function has returned."""
    import threading
    import time

    from spark_runner._task import finish_together

    arrived: dict[int, float] = {}
    returned: dict[int, float] = {}

    def rank(r: int, late_s: float) -> None:
        time.sleep(late_s)
        arrived[r] = time.monotonic()
        finish_together(r, 3)
        returned[r] = time.monotonic()

    threads = [threading.Thread(target=rank, args=(r, 0.3 if r == 2 else 0.0)) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(returned) == [0, 1, 2]
    assert all(returned[r] >= arrived[2] for r in range(3))  # none left before the last came


def test_finish_together_fails_the_task_when_rank_0s_store_goes_before_every_rank_came(
    job_store, monkeypatch
):
    """Rank 0 failed (its process drops the store it serves) while this rank waited: this
    task fails too, naming why, so that Spark reruns the whole stage."""
    import gc
    import threading

    from spark_runner import _task

    monkeypatch.setattr(_task, "SECONDARY_FAILURE_DELAY_S", 0.0)
    errors: list[str] = []

    def rank_1() -> None:
        try:
            _task.finish_together(1, 3)
        except RuntimeError as exc:
            errors.append(str(exc))

    t = threading.Thread(target=rank_1)
    t.start()
    t.join(0.5)
    assert t.is_alive()  # waiting for ranks 0 and 2
    job_store.clear()  # rank 0's process ends: its store is gone
    gc.collect()
    t.join(30)
    assert not t.is_alive() and len(errors) == 1
    assert errors[0].startswith("rank 1 returned, but lost the job's store (rank 0's)")
    assert "Spark reruns the stage" in errors[0]
