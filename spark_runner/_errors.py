"""Carrying a worker's error through Spark intact — and only a worker's.

Spark reports a failed task as text (a Py4J error holding the Python traceback), so
the task raises a RuntimeError whose message embeds the pickled
:class:`ringcore.WorkerError` between markers; the driver finds and unpickles it.

That text also holds whatever the user's exception said, and an exception message can
be built from data (``KeyError(repr(row_value))``), so a marker in the text proves
nothing. Each blob therefore carries an HMAC-SHA256 tag keyed by the job's log-server
secret, which only the driver and the job's own tasks hold (:class:`TaskSpec`
``secret``); the driver unpickles a blob only after its tag checks out, and ignores
(with a warning) every other one, so forged text never reaches ``cloudpickle.loads``.
"""

from __future__ import annotations

import base64
import logging
import os
import re
import sys
import zlib

import cloudpickle

from ringcore import RingError, WorkerError
from ringcore.launch import mac, verify

log = logging.getLogger("ringtrain.spark_runner")

_BEGIN, _END = "<<ringtrain-worker-error:", ":ringtrain-worker-error>>"
_PATTERN = re.compile(
    re.escape(_BEGIN) + r"(?:([0-9a-f]{64}):)?([A-Za-z0-9+/=]+)" + re.escape(_END)
)
_PURPOSE = "ringtrain/spark-worker-error"


def _tag(secret: str, blob: str) -> str:
    return mac(secret, _PURPOSE, blob).hex()


def encode_worker_error(err: WorkerError, secret: str) -> str:
    """The text a failed task raises: readable first, then the signed, pickled error."""
    if not secret:
        raise ValueError("encode_worker_error needs the job's secret (TaskSpec.secret), got none")
    blob = base64.b64encode(zlib.compress(cloudpickle.dumps(err))).decode("ascii")
    return (
        f"{err.error_type} on rank {err.rank}: {err.message} "
        f"{_BEGIN}{_tag(secret, blob)}:{blob}{_END}"
    )


def decode_worker_error(text: str, secret: str | None) -> WorkerError | None:
    """The worker error embedded in ``text`` (a Spark failure message) by one of this
    job's tasks, if any: only blobs whose HMAC under ``secret`` checks out are unpickled
    (with no secret, none is). When several are, prefer the root cause over a peer's
    RingInternalError."""
    found = []
    forged = 0
    for match in _PATTERN.finditer(text):
        tag, blob = match.group(1), match.group(2)
        if not secret or tag is None or not verify(_tag(secret, blob), tag):
            forged += 1
            continue
        try:
            err = cloudpickle.loads(zlib.decompress(base64.b64decode(blob)))
        except Exception:
            continue
        if isinstance(err, WorkerError):
            found.append(err)
    if forged:
        log.warning(
            "ignored %d worker-error blob(s) in a Spark failure message that this job's "
            "tasks did not sign (text from user data, or another job's); not unpickled",
            forged,
        )
    roots = [e for e in found if e.error_type != "RingInternalError"]
    return roots[0] if roots else (found[0] if found else None)


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
