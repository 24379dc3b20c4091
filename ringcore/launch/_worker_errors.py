"""The worker-error codec: a worker's error carried to the driver intact — and only a
worker's.

A failed worker sends its :class:`ringcore.WorkerError`, pickled, on its authenticated
log-server connection (a ``W`` line, under a random reference) and then raises an
exception that holds only what a person reads (:func:`task_failure_text`): the error's
type, rank, host and message and the line that raised it, and the reference. A launcher
such as Spark logs that text once per failed task, so it stays a few lines long. The
driver finds the reference in the launcher's failure text, waits (bounded) for that blob
to arrive on the log server and raises the error (:func:`find_worker_error`).

Where a worker has no log-server connection (the driver's address unreachable, e.g. a
Spark Connect client behind NAT, or the connection refused or lost), the blob goes in the
exception text itself (:func:`encode_worker_error`): the launcher's failure text is then
the only way to the driver.

A blob is trusted only when its HMAC-SHA256 tag, keyed by the job's log secret (which
only the driver and the job's own workers hold), checks out: an exception message can be
built from data (``KeyError(repr(row_value))``) and so hold our markers, and a line on
the socket could be injected. The driver unpickles a blob only after its tag checks out
and ignores (with a warning) every other one, so forged text never reaches
``cloudpickle.loads`` (:func:`decode_worker_error`). The secret itself never appears in
a blob, the exception text or the ``W`` line. Nothing here knows the transport.
"""

from __future__ import annotations

import base64
import logging
import re
import secrets
import zlib
from typing import Any

import cloudpickle

from .._auth import mac, verify
from .._errors import WorkerError
from ._log_server import ERROR_TAG, MAX_LINE_BYTES, LogServer

__all__ = [
    "decode_worker_error",
    "encode_worker_error",
    "find_worker_error",
    "signed_blob",
    "task_failure_text",
    "worker_error_summary",
]

log = logging.getLogger("ringtrain.ringcore.launch")

_BEGIN, _END = "<<ringtrain-worker-error:", ":ringtrain-worker-error>>"
_PATTERN = re.compile(
    re.escape(_BEGIN) + r"(?:([0-9a-f]{64}):)?([A-Za-z0-9+/=]+)" + re.escape(_END)
)
_PURPOSE = "ringtrain/worker-error"


def _tag(secret: str, blob: str) -> str:
    return mac(secret, _PURPOSE, blob).hex()


#: the part of a failed worker's exception that names its error on the log server
_REF = re.compile(r"ringtrain worker error ([0-9a-f]{16})")
#: how much of the worker's message the exception (what a launcher logs) repeats
MAX_MESSAGE_CHARS = 500
#: how long the driver waits for an error named in the launcher's failure text to arrive
ERROR_WAIT_S = 5.0
#: a blob longer than this keeps _KEEP_CHARS of the message (its start) and traceback (its end)
_MAX_BLOB_CHARS = MAX_LINE_BYTES - 1024
_KEEP_CHARS = 1 << 15


def _blob(err: WorkerError, secret: str) -> str:
    blob = base64.b64encode(zlib.compress(cloudpickle.dumps(err))).decode("ascii")
    return f"{_BEGIN}{_tag(secret, blob)}:{blob}{_END}"


def signed_blob(err: WorkerError, secret: str) -> str:
    """``err`` pickled, compressed, base64'd and signed, between markers; short enough
    for one log-server line (a huge message keeps its start, a huge traceback its end)."""
    if not secret:
        raise ValueError("a worker error needs the job's log secret (LogServer.secret), got none")
    text = _blob(err, secret)
    if len(text) <= _MAX_BLOB_CHARS:
        return text
    cut = WorkerError(
        err.rank,
        err.host,
        err.error_type,
        err.message[:_KEEP_CHARS],
        "... (cut)\n" + err.traceback[-_KEEP_CHARS:],
        err.output[-_KEEP_CHARS:],
    )
    return _blob(cut, secret)


def _raising_line(traceback: str) -> str:
    """The innermost ``File ..., line N, in f`` line of a traceback and its code line."""
    lines = traceback.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if not frames:
        return ""
    i = frames[-1]
    code = lines[i + 1] if i + 1 < len(lines) and lines[i + 1].startswith("    ") else ""
    return "\n".join(line for line in (lines[i], code) if line)


def worker_error_summary(err: WorkerError) -> str:
    """``ValueError on rank 1 (host): message`` and the line that raised it: what a person
    reads of the error in the launcher's own log lines (Spark's) (the message cut at MAX_MESSAGE_CHARS)."""
    message = err.message
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[:MAX_MESSAGE_CHARS] + " ..."
    head = f"{err.error_type} on rank {err.rank} ({err.host}): {message}"
    frame = _raising_line(err.traceback)
    return f"{head}\n{frame}" if frame else head


def encode_worker_error(err: WorkerError, secret: str) -> str:
    """The text a failed worker with no log-server connection raises: readable first, then
    the signed, pickled error (the launcher's failure text is its only way to the driver)."""
    return f"{worker_error_summary(err)} {signed_blob(err, secret)}"


def task_failure_text(err: WorkerError, secret: str, conn: Any) -> str:
    """The text a failed worker raises. With a log-server connection ``conn``
    (:class:`~._log_client.LogConnection`), the signed error goes on it under a new
    reference and the text holds the summary and that reference; without one (or when
    sending fails) the text embeds the signed error (:func:`encode_worker_error`)."""
    if conn is not None:
        ref = secrets.token_hex(8)
        try:
            conn.send(ERROR_TAG, f"{ref} {signed_blob(err, secret)}")
        except OSError:
            pass  # the driver went away: the text is the only way left
        else:
            return (
                f"{worker_error_summary(err)}\n(ringtrain worker error {ref}: the driver "
                "raises it as ringcore.WorkerError, with its traceback)"
            )
    return encode_worker_error(err, secret)


def find_worker_error(
    text: str,
    server: LogServer,
    secret: str | None,
    wait_s: float = ERROR_WAIT_S,
    peers: bool = True,
) -> WorkerError | None:
    """The worker error behind a failed job whose failure text is ``text``: the
    errors it names, as they arrived on the log server ``server`` (waiting up to
    ``wait_s`` for them), else one embedded in ``text`` by a worker without a connection.
    ``peers``: also weigh the other errors the server holds (a barrier stage's other
    ranks), so a root cause wins over a peer's RingInternalError."""
    refs = _REF.findall(text)
    sent = server.wait_for_errors(refs, wait_s) if refs else []
    if sent and peers:
        sent += [blob for blob in server.worker_errors() if blob not in sent]
    found = decode_worker_error("\n".join(sent), secret) if sent else None
    return found if found is not None else decode_worker_error(text, secret)


def decode_worker_error(text: str, secret: str | None) -> WorkerError | None:
    """The worker error in ``text`` (a launcher's failure message, or the blobs the log server
    received) from one of this job's workers, if any: only blobs whose HMAC under
    ``secret`` checks out are unpickled (with no secret, none is). When several are,
    the first root cause wins over a peer's RingInternalError."""
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
            "ignored %d worker-error blob(s) in a failure that this job's workers did not "
            "sign (text from user data, or another job's); not unpickled",
            forged,
        )
    roots = [e for e in found if e.error_type != "RingInternalError"]
    return roots[0] if roots else (found[0] if found else None)
