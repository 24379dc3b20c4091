"""A driver whose Spark executors run another Python, one without torch or ringtrain (a
script started with a virtualenv's python while the executors start the system
``python3``): ``spark_runner.run`` must say which interpreter the executors run, what it
cannot import, and how to point them elsewhere — not a ModuleNotFoundError from deep
inside a Spark task. In a subprocess: a SparkContext is one per process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.spark

# A session built as a user's script builds it (not spark_runner.local_session, which sets
# PYSPARK_PYTHON to its own interpreter), with PYSPARK_PYTHON naming the bare interpreter.
_DRIVER = """
from pyspark.sql import SparkSession
import spark_runner
from ringcore import RingError

spark = (
    SparkSession.builder.master("local[2]").appName("test_executor_python")
    .config("spark.driver.host", "127.0.0.1").config("spark.driver.bindAddress", "127.0.0.1")
    .config("spark.ui.enabled", "false").getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
try:
    spark_runner.run(lambda: 1, num_proc=2, verbose=0)
except RingError as err:
    print("RINGERROR", err)
else:
    print("NO ERROR")
finally:
    spark.stop()
"""


def _bare_python() -> str | None:
    """This venv's base interpreter (the same binary without the venv's packages), when it
    lacks torch, as a system python3 does."""
    base = os.path.join(
        sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"
    )
    if not os.access(base, os.X_OK):
        return None
    probe = subprocess.run([base, "-c", "import torch"], capture_output=True, timeout=60)
    return None if probe.returncode == 0 else base


@pytest.mark.timeout(300)
def test_executors_on_a_python_without_ringtrain_get_an_error_naming_it_and_the_fix():
    bare = _bare_python()
    if bare is None:
        pytest.skip("no interpreter without torch beside this venv's to run the executors on")
    env = {**os.environ, "PYSPARK_PYTHON": bare, "SPARK_LOCAL_IP": "127.0.0.1"}
    proc = subprocess.run(
        [sys.executable, "-c", _DRIVER], env=env, capture_output=True, text=True, timeout=240
    )
    out = proc.stdout
    assert proc.returncode == 0 and "RINGERROR" in out, out[-3000:] + proc.stderr[-3000:]
    message = out.split("RINGERROR", 1)[1]
    assert f"the Spark executors' Python, {bare} (PYSPARK_PYTHON)" in message
    assert "cannot import '" in message and "export PYSPARK_PYTHON before" in message
    assert "spark.pyspark.python" in message
    assert sys.executable in message  # the interpreter that has it, as the fix to try
    assert "spark_runner.run of <lambda> on 2 tasks failed before it started" in message
