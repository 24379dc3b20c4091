"""SparkSessions: which kind a session is (classic or Spark Connect), this process's
Connect session, and one set up the way ringtrain's workers need it, for scripts and tests.

:func:`local_session` sets what users otherwise trip over: ``PYSPARK_PYTHON`` (executors
must run this interpreter, which has torch), loopback binding, and for ``local-cluster``
masters ``SPARK_HOME`` (the pyspark package) and ``SPARK_WORKER_DIR`` (else executors
write into site-packages).
"""

from __future__ import annotations

import os
import sys
import tempfile
from typing import Any

from ringcore import RingError

from ._platform import defaults


def is_connect(spark: Any) -> bool:
    """Whether ``spark`` is a Spark Connect session (no SparkContext on this side)."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def application_id(spark: Any) -> str:
    """The Spark application's id (``spark.app.id``; ``"spark"`` where it cannot be read):
    the first part of the ``TORCHELASTIC_RUN_ID`` of ``run``'s tasks."""
    try:
        if is_connect(spark):
            return str(spark.conf.get("spark.app.id", "spark") or "spark")
        return str(spark.sparkContext.applicationId)
    except Exception:  # a Connect server that hides its conf: the stage id still tells jobs apart
        return "spark"


def connect_session() -> Any:
    """The active (else default) Spark Connect session of this process, or None."""
    try:
        from pyspark.sql.connect.session import SparkSession
    except ImportError:  # the connect extras (grpcio, ...) are not installed
        return None
    active = SparkSession.getActiveSession()
    if active is not None:
        return active
    # pyspark >= 4.0 keeps a default session beside the active one; 3.5 has only the latter
    default = getattr(SparkSession, "_get_default_session", None)
    return default() if default is not None else None


def local_session(
    master: str = "local[2]",
    app_name: str = "ringtrain",
    conf: dict[str, str] | None = None,
    log_level: str | None = None,
) -> Any:
    """Create (or get) a SparkSession on this machine bound to 127.0.0.1. On Databricks
    (``DATABRICKS_RUNTIME_VERSION`` set) it returns the notebook's active session and
    ignores the arguments, so a script written against a local session runs unchanged.
    ``log_level`` (e.g. ``"ERROR"``) sets the new session's Spark log level, so a
    notebook need not reach for the SparkContext itself.

    A session already running in this process is returned when it has the asked master
    and settings (as ``getOrCreate`` does); one with another master, or another value of
    a setting that only takes effect at start-up (anything but ``spark.sql.*``), raises
    ``RingError`` naming both: ``getOrCreate`` would hand back the running one and drop
    the asked settings without a word."""
    import pyspark
    from pyspark.sql import SparkSession

    if defaults().use_active_session:
        active = SparkSession.getActiveSession()
        if active is None:
            raise RingError(
                f"{defaults().platform}: no active SparkSession; run this in a notebook or job "
                "attached to a cluster (its `spark` session is used)."
            )
        return active

    os.environ["PYSPARK_PYTHON"] = sys.executable
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    if master.startswith("local-cluster"):
        os.environ.setdefault("SPARK_HOME", os.path.dirname(pyspark.__file__))
        os.environ.setdefault("SPARK_WORKER_DIR", tempfile.mkdtemp(prefix="ringtrain-spark-work-"))
    builder = (
        SparkSession.builder.master(master)
        .appName(app_name)
        .config("spark.driver.host", "127.0.0.1")
        .config("spark.driver.bindAddress", "127.0.0.1")
        .config("spark.ui.enabled", "false")
        .config("spark.ui.showConsoleProgress", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.sql.execution.arrow.pyspark.enabled", "true")
        .config("spark.executorEnv.PYSPARK_PYTHON", sys.executable)
    )
    for key, value in (conf or {}).items():
        builder = builder.config(key, value)
    _refuse_a_running_context_of_other_settings(master, conf or {})
    session = builder.getOrCreate()
    if log_level is not None:
        session.sparkContext.setLogLevel(log_level)
    return session


def _refuse_a_running_context_of_other_settings(master: str, conf: dict[str, str]) -> None:
    from pyspark import SparkContext

    running = SparkContext._active_spark_context
    if running is None:
        return
    have = running.getConf()
    wanted = {
        "spark.master": master,
        **{k: v for k, v in conf.items() if not k.startswith("spark.sql.")},
    }
    differ = {
        key: (have.get(key), value)
        for key, value in wanted.items()
        if _canonical(key, have.get(key)) != _canonical(key, value)
    }
    if differ:
        named = "; ".join(
            f"{key} is {got!r}, asked {value!r}" for key, (got, value) in differ.items()
        )
        raise RingError(
            f"local_session: a SparkSession is already running in this process with other "
            f"start-up settings ({named}); Spark would return it unchanged. Stop it first "
            "(spark.stop()), or ask for the settings it has."
        )


def _canonical(key: str, value: str | None) -> str | None:
    # "local[2, 1]" and "local[2,1]" are one master
    return value.replace(" ", "") if key == "spark.master" and value is not None else value
