"""One SparkSession shared by the test modules that need nothing but ``local[2]``.

A module's own session costs it a JVM start, a first job, and Python workers that import
torch, pyarrow and the project cold (about 45 s on 2 cores before its first fit trains);
the shared session pays that once per test process. A module that uses it says so with
``SHARED_SPARK = True`` (conftest.py runs those modules first, so the session starts
once), gets it from :func:`shared_session` and never stops it: conftest.py stops it
before the first module not on it, and when the test process ends. A module of another
master or start-up setting makes and stops its own session, as before.
``spark_runner.local_session`` refuses to hand back a running session of other settings,
so a module that forgets this fails naming the settings instead of running on the wrong
master.
"""

from __future__ import annotations

from typing import Any

SHARED_MASTER = "local[2]"
SHARED_CONF = {"spark.sql.shuffle.partitions": "2"}

_shared: Any = None


def shared_session() -> Any:
    """The shared ``local[2]`` session, started on first use (again after a stop)."""
    global _shared
    import spark_runner

    if _shared is None or _shared.sparkContext._jsc is None:
        _shared = spark_runner.local_session(
            SHARED_MASTER, app_name="ringtrain-tests", conf=SHARED_CONF, log_level="ERROR"
        )
    else:
        _shared.sparkContext.setLogLevel("ERROR")  # a module may have changed it
    return _shared


def stop_shared() -> None:
    """Stops the shared session if it runs (a no-op otherwise)."""
    global _shared
    if _shared is not None:
        session, _shared = _shared, None
        if session.sparkContext._jsc is not None:
            session.stop()


def fit_refused_before_any_job(spark: Any, estimator: Any, df: Any) -> str:
    """``estimator.fit(df)`` raises ``ValueError`` with no Spark job run on ``spark``
    (asserted); returns the message."""
    import uuid

    import pytest

    sc = spark.sparkContext
    group = f"refused-{uuid.uuid4().hex[:8]}"
    sc.setJobGroup(group, "bad input: no job may run")
    try:
        with pytest.raises(ValueError) as info:
            estimator.fit(df)
        assert sc.statusTracker().getJobIdsForGroup(group) == []
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    return str(info.value)
