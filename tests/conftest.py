"""Settings for every test process and what it starts.

The JVMs the tests start (Spark drivers, local-cluster executors, standalone masters and
workers, Spark Connect servers) live for seconds to a minute and run little code hot,
so they get C1 alone (``-XX:TieredStopAtLevel=1``) and the serial collector, which change
nothing they compute. Measured on 2 cores: test_estimator_fit.py + test_spark_runner.py
184 -> 169 s; the whole main suite showed no gain on a noisy machine (61.8 min with the
flags, 58.1 without, the same afternoon). ``JAVA_TOOL_OPTIONS`` reaches every JVM started below
this process, whatever starts it; a value already set wins (``JAVA_TOOL_OPTIONS=``,
empty, runs the JVMs as they come). Each JVM prints one "Picked up JAVA_TOOL_OPTIONS"
line on its stderr.
"""

from __future__ import annotations

import os

import pytest

TEST_JVM_OPTIONS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"

os.environ.setdefault("JAVA_TOOL_OPTIONS", TEST_JVM_OPTIONS)


def pytest_collection_modifyitems(session, config, items):
    """The modules on the shared SparkSession (tests/_spark.py) run first, those on the
    shared Ray instance (``SHARED_RAY = True``, tests/_servers.py ``local_ray``) last
    among them and right after, then the rest, each group in its usual order: the
    session and the instance start once, not once per run of shared modules between
    the others; the modules on the shared Spark Connect server (tests/_connect_server.py,
    ``SHARED_CONNECT = True``) last. Items of one module stay together."""

    def group(item) -> int:
        module = getattr(item, "module", None)
        spark, ray = _on(module, "SHARED_SPARK"), _on(module, "SHARED_RAY")
        if _on(module, "SHARED_CONNECT"):
            return 4
        return 0 if spark and not ray else 1 if spark else 2 if ray else 3

    items.sort(key=group)  # a stable sort: each group keeps its order


def _on(module, marker: str) -> bool:
    return bool(getattr(module, marker, False))


@pytest.fixture(autouse=True, scope="module")
def _shared_servers_end_before_the_other_modules(request):
    """The first module not on the shared session (or the shared Ray instance) stops
    it: the rest of the suite runs without its JVM, Ray daemons and workers, as
    before they were shared."""
    if not _on(request.module, "SHARED_SPARK"):
        import _spark

        _spark.stop_shared()
    if not _on(request.module, "SHARED_RAY"):
        import _servers

        _servers.stop_shared_ray()


def pytest_sessionfinish(session, exitstatus):
    import _connect_server
    import _servers
    import _spark

    _spark.stop_shared()
    _servers.stop_shared_ray()
    _connect_server.stop_shared()
