"""Errors of Spark's own making: a task that failed before any of our code ran,
because the executors' Python cannot import a module.

A worker's own error reaches the driver through ``ringcore.launch``'s worker-error
codec (signed, on the task's log-server connection, or in Spark's failure text).
"""

from __future__ import annotations

import os
import re
import sys

from ringcore import RingError

_MISSING_MODULE = re.compile(r"ModuleNotFoundError: No module named '([\w.]+)'")


def executors_python(python_exec: str | None, conf_get) -> str:
    """The interpreter Spark's executors run: the SparkContext's ``pythonExec`` where
    there is one (classic sessions: ``PYSPARK_PYTHON``, else ``python3``), else what the
    session's conf names (``spark.pyspark.python``, ``spark.executorEnv.PYSPARK_PYTHON``),
    else Spark's default, ``python3`` on the executors' PATH. ``conf_get(key)`` reads
    one conf key, None when unset."""
    if python_exec:
        source = "PYSPARK_PYTHON" if os.environ.get("PYSPARK_PYTHON") else "Spark's default"
        return f"{python_exec} ({source})"
    for key in ("spark.pyspark.python", "spark.executorEnv.PYSPARK_PYTHON"):
        value = conf_get(key)
        if value:
            return f"{value} ({key})"
    return "python3 on the executors' PATH (Spark's default)"


def executor_import_error(text: str, python: str, what: str) -> RingError | None:
    """A clear error when a Spark task failed before any of our code ran because the
    executors' Python cannot import a module (torch, ringcore, the user's): Spark's
    text names only the module, deep in a traceback. None when ``text`` says no such
    thing. ``python`` is :func:`executors_python`'s answer, ``what`` the job."""
    match = _MISSING_MODULE.search(text)
    if match is None:
        return None
    module = match.group(1)
    return RingError(
        f"{what} failed before it started: the Spark executors' Python, {python}, cannot "
        f"import {module!r} (ModuleNotFoundError on the executors). The executors run "
        f"their own interpreter, not this one ({sys.executable}). Install ringtrain and "
        "its dependencies (torch, ...) into the executors' Python, or point the executors "
        "at an interpreter that has them: export PYSPARK_PYTHON before the SparkSession is "
        f"created (e.g. PYSPARK_PYTHON={sys.executable} on a single machine), or set "
        "spark.pyspark.python with spark-submit --conf or in the cluster's Spark config; on "
        "a cluster, an interpreter present on every worker."
    )
