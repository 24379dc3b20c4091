"""A real Spark Connect server for tests, started from the pyspark package
(``spark-submit --class ...SparkConnectServer``) on 127.0.0.1, and a client session on
it; both stopped at the end (the server by PID, with the Python workers it started).

Used by tests/spark_runner/test_spark_connect.py (spark_runner on Connect) and
tests/estimators/test_estimator_connect.py (RingEstimator on Connect). Both run on one
``local[2]`` server, :func:`shared_server` (``SHARED_CONNECT = True``: conftest.py runs
those modules last, one after the other, and stops the server when the test process
ends), which saves a server start and its Python workers' cold start; a server on
another master is a module's own, for as long as it needs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _servers import free_port, wait_for_port

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
START_TIMEOUT_S = 90


def _read(path: Path) -> str:
    with open(path) as fh:
        return fh.read()


def _stop_tree(proc: subprocess.Popen) -> None:
    """Stop the server we started and whatever it started (its Python workers)."""
    import psutil

    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
    for child in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            child.kill()


@contextlib.contextmanager
def connect_server(
    work: Path, master: str = "local[2]", name: str = "ringtrain-test", conf: dict | None = None
) -> Iterator[str]:
    """A Spark Connect server on ``master`` (its log and working files in ``work``);
    yields its ``sc://`` URL. Its executors run this interpreter (``PYSPARK_PYTHON``)."""
    import pyspark

    home = os.path.dirname(pyspark.__file__)
    port, log = free_port(), work / "server.log"
    env = dict(
        os.environ, SPARK_HOME=home, SPARK_LOCAL_IP="127.0.0.1", PYSPARK_PYTHON=sys.executable
    )
    env.pop("SPARK_CONNECT_MODE_ENABLED", None)
    settings = {
        "spark.connect.grpc.binding.address": "127.0.0.1",
        "spark.connect.grpc.binding.port": str(port),
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.ui.enabled": "false",
        "spark.ui.showConsoleProgress": "false",
        "spark.executorEnv.PYSPARK_PYTHON": sys.executable,
        **(conf or {}),
    }
    command = [os.path.join(home, "bin", "spark-submit"), "--class", SERVER_CLASS]
    command += ["--master", master, "--name", name]
    for key, value in settings.items():
        command += ["--conf", f"{key}={value}"]
    command.append("spark-internal")
    with open(log, "wb") as out:
        proc = subprocess.Popen(command, env=env, cwd=work, stdout=out, stderr=out)
    try:
        wait_for_port(port, proc, START_TIMEOUT_S, "the Spark Connect server", lambda: _read(log))
        yield f"sc://localhost:{port}"
    finally:
        _stop_tree(proc)


@contextlib.contextmanager
def remote_session(url: str) -> Iterator[Any]:
    """A client session on the server at ``url``; stopped at the end, and the process
    marked classic again (the builder marks the whole process as Connect)."""
    from pyspark.sql import SparkSession

    had_mode = "SPARK_CONNECT_MODE_ENABLED" in os.environ
    session = SparkSession.builder.remote(url).getOrCreate()
    try:
        yield session
    finally:
        session.stop()
        if not had_mode:
            os.environ.pop("SPARK_CONNECT_MODE_ENABLED", None)


_shared: dict[str, tuple[contextlib.ExitStack, str, Path]] = {}


def shared_server(master: str = "local[2]") -> tuple[str, Path]:
    """The test process's server on ``master`` (started on first use) and its working
    directory: ``(sc:// URL, folder)``."""
    if master not in _shared:
        work = Path(tempfile.mkdtemp(prefix="ringtrain-connect-"))
        stack = contextlib.ExitStack()
        stack.callback(shutil.rmtree, work, True)
        url = stack.enter_context(connect_server(work, master, name="ringtrain-tests-connect"))
        _shared[master] = (stack, url, work)
    _, url, work = _shared[master]
    return url, work


def stop_shared() -> None:
    """Stops every shared server that runs (a no-op if none does)."""
    while _shared:
        stack, _, _ = _shared.popitem()[1]
        stack.close()
