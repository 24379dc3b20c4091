"""Settings for every test process and what it starts.

The JVMs the tests start (Spark drivers, local-cluster executors, standalone masters and
workers, Spark Connect servers) live for seconds to a minute and run little code hot,
so they get C1 alone (``-XX:TieredStopAtLevel=1``) and the serial collector, which change
nothing they compute. Measured on 2 cores: test_estimators.py + test_spark_runner.py
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
    """The modules on the shared SparkSession (tests/_spark.py) run first, in their
    usual order, then the rest in theirs: the session starts once, not once per run of
    shared modules between the others. Items of one module stay together."""
    items.sort(key=lambda item: not _on_shared_spark(getattr(item, "module", None)))


def _on_shared_spark(module) -> bool:
    return bool(getattr(module, "SHARED_SPARK", False))


@pytest.fixture(autouse=True, scope="module")
def _shared_spark_ends_before_the_other_modules(request):
    """The first module not on the shared session stops it: the rest of the suite runs
    without its JVM and Python workers, as before the session was shared."""
    if not _on_shared_spark(request.module):
        import _spark

        _spark.stop_shared()


def pytest_sessionfinish(session, exitstatus):
    import _spark

    _spark.stop_shared()
