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
