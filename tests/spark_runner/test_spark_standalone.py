"""spark_runner.run on a real standalone cluster: one master and two 1-core workers on
127.0.0.1, started from the pyspark package's own scripts and stopped by PID."""

from __future__ import annotations

import io
import os
import subprocess
import sys

import pytest
from _servers import free_port, wait_for_port

import spark_runner

pytestmark = [pytest.mark.spark, pytest.mark.slow]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=15)


@pytest.fixture(scope="module")
def standalone(tmp_path_factory):
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    work = tmp_path_factory.mktemp("spark-standalone")
    env = dict(
        os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable
    )
    spark_class = os.path.join(home, "bin", "spark-class")
    port = free_port()
    procs: list[subprocess.Popen] = []

    def start(*args: str, log: str) -> subprocess.Popen:
        with open(work / log, "wb") as out:
            proc = subprocess.Popen([spark_class, *args], env=env, stdout=out, stderr=out)
        procs.append(proc)
        return proc

    try:
        master = start(
            "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1", "--port", str(port),
            "--webui-port", "0", log="master.log",
        )  # fmt: skip
        wait_for_port(port, master, 60, "the standalone master")
        for i in range(2):
            start(
                "org.apache.spark.deploy.worker.Worker", f"spark://127.0.0.1:{port}",
                "--host", "127.0.0.1", "--cores", "1", "--memory", "1g", "--webui-port", "0",
                "--work-dir", str(work / f"worker{i}"), log=f"worker{i}.log",
            )  # fmt: skip
        session = spark_runner.local_session(
            f"spark://127.0.0.1:{port}",
            app_name="test_spark_standalone",
            conf={"spark.executor.cores": "1", "spark.executor.memory": "512m"},
        )
        try:
            yield session
        finally:
            session.stop()
    finally:
        for proc in reversed(procs):
            _stop(proc)


def _ring():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    print(f"rank {hvd.rank()} of {hvd.size()}")
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return hvd.rank(), hvd.local_rank(), total, os.getpid()


def test_run_on_a_standalone_cluster_waits_for_its_workers_and_forms_one_ring(standalone):
    out = io.StringIO()
    results = spark_runner.run(_ring, num_proc=2, start_timeout=90, stdout=out)
    assert [r[:3] for r in results] == [(0, 0, 3.0), (1, 1, 3.0)]
    assert len({r[3] for r in results}) == 2
    assert "[0]<stdout>:rank 0 of 2" in out.getvalue().splitlines()
    assert "[1]<stdout>:rank 1 of 2" in out.getvalue().splitlines()
