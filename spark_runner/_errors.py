"""Carrying a worker's error through Spark intact.

Spark reports a failed task as text (a Py4J error holding the Python traceback), so
the task raises a RuntimeError whose message embeds the pickled
:class:`ringcore.WorkerError` between markers; the driver finds and unpickles it.
"""

from __future__ import annotations

import base64
import re
import zlib

import cloudpickle

from ringcore import WorkerError

_BEGIN, _END = "<<ringtrain-worker-error:", ":ringtrain-worker-error>>"
_PATTERN = re.compile(re.escape(_BEGIN) + r"([A-Za-z0-9+/=]+)" + re.escape(_END))


def encode_worker_error(err: WorkerError) -> str:
    blob = base64.b64encode(zlib.compress(cloudpickle.dumps(err))).decode("ascii")
    return f"{err.error_type} on rank {err.rank}: {err.message} {_BEGIN}{blob}{_END}"


def decode_worker_error(text: str) -> WorkerError | None:
    """The worker error embedded in ``text`` (a Spark failure message), if any. When
    several are, prefer the root cause over a peer's RingInternalError."""
    found = []
    for match in _PATTERN.finditer(text):
        try:
            err = cloudpickle.loads(zlib.decompress(base64.b64decode(match.group(1))))
        except Exception:
            continue
        if isinstance(err, WorkerError):
            found.append(err)
    roots = [e for e in found if e.error_type != "RingInternalError"]
    return roots[0] if roots else (found[0] if found else None)
