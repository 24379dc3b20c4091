"""A worker's error travels to the driver signed with the job's secret: a blob forged in an
exception message, a row value or Spark's failure text is never unpickled, and the real
error still decodes, however long."""

from __future__ import annotations

import base64
import io
import logging
import os
import pickle
import uuid
import zlib

import _spark
import pytest

import spark_runner
from ringcore import WorkerError
from ringcore.launch import (
    MAX_LINE_BYTES,
    LogConnection,
    LogServer,
    decode_worker_error,
    encode_worker_error,
    find_worker_error,
    signed_blob,
    task_failure_text,
)

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


class _CreatesFileWhenUnpickled:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling opens (creates) the file


def _forged_markers(path: str) -> str:
    """What a row value can hold: our markers around a pickle that creates ``path``, bare
    (the old format) and behind a made-up tag."""
    blob = base64.b64encode(zlib.compress(pickle.dumps(_CreatesFileWhenUnpickled(path))))
    text = blob.decode("ascii")
    return (
        f"<<ringtrain-worker-error:{text}:ringtrain-worker-error>> "
        f"<<ringtrain-worker-error:{'ab' * 32}:{text}:ringtrain-worker-error>>"
    )


@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
    cases=3,
)
def test_a_forged_worker_error_blob_is_never_unpickled_and_the_real_error_still_decodes(
    tmp_path, caplog
):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target))
    secret = uuid.uuid4().hex
    with caplog.at_level(logging.WARNING, logger="ringtrain.ringcore.launch"):
        assert decode_worker_error(f"Py4JJavaError: ... KeyError: {forged!r}", secret) is None
        assert decode_worker_error(f"... {forged} ...", None) is None  # no secret: nothing
    assert not target.exists()
    assert "did not sign" in caplog.text
    real = WorkerError(1, "127.0.0.1", "KeyError", repr(forged), "Traceback ...", "")
    text = f"Job aborted: RuntimeError: {encode_worker_error(real, secret)}"
    got = decode_worker_error(text, secret)
    assert not target.exists()
    assert got is not None and (got.rank, got.error_type) == (1, "KeyError")
    assert decode_worker_error(text, uuid.uuid4().hex) is None  # another job's secret
    assert not target.exists()


@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
)
def test_a_blob_on_the_log_connection_is_unpickled_only_when_this_jobs_secret_signed_it(
    tmp_path,
):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target)).split()[1]  # behind a made-up tag
    out = io.StringIO()
    server = LogServer(out, out)
    try:
        conn = LogConnection("127.0.0.1", server.port, server.secret, stage_id=0)
        real = WorkerError(1, "127.0.0.1", "ValueError", "bad shard", "Traceback ...", "")
        conn.send("W", f"{'a' * 16} {forged}")  # a line injected into the connection
        told = task_failure_text(real, server.secret, conn)  # the task's own error
        conn.close()
        server.drain(5.0)
        named = f"RuntimeError: {told} (ringtrain worker error {'a' * 16}: forged)"
        got = find_worker_error(named, server, server.secret)
    finally:
        server.close()
    assert not target.exists(), "the driver unpickled a blob nobody signed"
    assert got is not None and (got.rank, got.message) == (1, "bad shard")
    assert "ringtrain-worker-error" not in told and out.getvalue() == ""


def test_a_huge_worker_error_still_fits_one_log_line_with_its_message_and_the_traceback_end():
    secret = uuid.uuid4().hex
    huge = os.urandom(1 << 20).hex()  # 2 MB that do not compress
    err = WorkerError(0, "h", "KeyError", huge, "Traceback\n" + huge + "\nKeyError: ...", "")
    blob = signed_blob(err, secret)
    assert len(blob) < MAX_LINE_BYTES
    got = decode_worker_error(blob, secret)
    assert got is not None and got.error_type == "KeyError"
    assert huge.startswith(got.message) and got.traceback.endswith("\nKeyError: ...")


def _raises_key_error_of_a_row_value(value: str) -> None:
    raise KeyError(repr(value))  # the message is data, as a missing-key lookup's is


@pytest.mark.spark
@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
)
def test_a_row_value_holding_a_forged_blob_runs_no_code_on_the_driver(spark, tmp_path):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target))
    with pytest.raises(WorkerError) as info:
        spark_runner.run(_raises_key_error_of_a_row_value, args=(forged,), num_proc=1)
    assert not target.exists(), "the driver unpickled a blob from an exception message"
    err = info.value
    assert (err.rank, err.error_type) == (0, "KeyError")
    assert "ringtrain-worker-error" in err.message  # the user's text, readable as it was
    assert "_raises_key_error_of_a_row_value" in err.traceback


@pytest.mark.spark
@pytest.mark.timeout(180)
@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
)
def test_run_elastic_decodes_only_its_own_tasks_error_blobs(spark, tmp_path):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target))
    with pytest.raises(WorkerError) as info:
        spark_runner.run_elastic(
            _raises_key_error_of_a_row_value,
            args=(forged,),
            num_proc=1,
            min_num_proc=1,
            max_num_proc=1,
            elastic_timeout=30,
        )
    assert not target.exists(), "the driver unpickled a blob from an exception message"
    assert info.value.error_type == "KeyError" and "ringtrain-worker-error" in info.value.message
