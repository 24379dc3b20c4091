"""What a user sees of a spark_runner job: a failed worker's error, Spark's own text for
the failed task, the order of the workers' last lines against the job's end line, and
the attempt number the ranks agree on (real Spark on the shared local[2] session)."""

from __future__ import annotations

import io
import logging
import os
import re
import socket
import threading
import time
from pathlib import Path

import _spark
import pytest

import spark_runner
from ringcore import WorkerError
from ringcore.launch import MAX_LINE_BYTES, LogConnection, LogServer
from spark_runner import _run
from spark_runner._task import UNKNOWN_ATTEMPT_BASE, agreed_attempt

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

_SHARD_ERROR = "rank 1 cannot read its shard"
_LONG_BASE64 = re.compile(r"[A-Za-z0-9+/=]{200,}")  # a pickled blob, as Spark would show it


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


class _Recorded(LogServer):
    """Seam: the job's log server, kept so the test knows its secret."""

    made: list[LogServer] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        _Recorded.made.append(self)


class _Unreachable(_Recorded):
    """Seam: a log server whose advertised port refuses connections (a firewall, a
    client behind NAT): the tasks run without a connection to the driver."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]  # closed again: connection refused


def _rank_1_fails(secret_file: str) -> str:
    if os.environ["RING_RANK"] == "1":
        Path(secret_file).write_text(os.environ["RING_SECRET_KEY"])
        raise ValueError(_SHARD_ERROR)
    return "done"


def _failed_run(monkeypatch, tmp_path, server_class) -> tuple[WorkerError, str, list[str]]:
    """The WorkerError of a job whose rank 1 raises, Spark's own text for the failed
    task (the Py4J error), and the job's secrets (the log server's and the ring's)."""
    _Recorded.made = []
    monkeypatch.setattr(_run, "LogServer", server_class)
    secret_file = tmp_path / "ring-secret"
    with pytest.raises(WorkerError) as info:
        spark_runner.run(_rank_1_fails, args=(str(secret_file),), num_proc=2, verbose=0)
    spark_text = str(info.value.__context__)  # the driver-side exception Spark raised
    assert "Py4JJavaError" in type(info.value.__context__).__name__
    return info.value, spark_text, [_Recorded.made[0].secret, secret_file.read_text()]


def _assert_intact(err: WorkerError) -> None:
    assert (err.rank, err.error_type, err.message) == (1, "ValueError", _SHARD_ERROR)
    assert "in _rank_1_fails" in err.traceback and err.traceback.rstrip().endswith(_SHARD_ERROR)


@pytest.mark.spark
@pytest.mark.reliability(
    fault="a worker raises: Spark's task-failure text and the driver's error", category="fault"
)
def test_a_failed_worker_is_raised_intact_while_spark_reports_only_its_summary(
    spark, monkeypatch, tmp_path
):
    err, spark_text, secrets = _failed_run(monkeypatch, tmp_path, _Recorded)
    _assert_intact(err)
    assert "ringtrain-worker-error" not in spark_text and not _LONG_BASE64.search(spark_text)
    assert not [s for s in secrets if s in spark_text], "a job secret is in Spark's text"
    # What the Python worker raised, as Spark logs it per failed task: a few short lines.
    told = re.search(
        r"RuntimeError: (.*?\(ringtrain worker error [0-9a-f]{16}[^)]*\))", spark_text, re.S
    )
    assert told, spark_text
    assert told.group(1).startswith(f"ValueError on rank 1 (127.0.0.1): {_SHARD_ERROR}")
    assert "in _rank_1_fails" in told.group(1)
    assert len(told.group(1)) < 400 and len(told.group(1).splitlines()) <= 4


@pytest.mark.spark
@pytest.mark.reliability(
    fault="a worker raises: Spark's task-failure text and the driver's error", category="fault"
)
def test_a_task_that_cannot_reach_the_driver_still_gets_its_error_to_it_through_spark(
    spark, monkeypatch, tmp_path
):
    err, spark_text, secrets = _failed_run(monkeypatch, tmp_path, _Unreachable)
    _assert_intact(err)
    assert "ringtrain-worker-error" in spark_text  # the only way left: the signed blob
    assert not [s for s in secrets if s in spark_text], "a job secret is in Spark's text"


class _SlowSink(io.StringIO):
    """Seam: a slow stdout (a notebook's, a pipe read late): 5 ms per line written."""

    def __init__(self):
        super().__init__()
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        time.sleep(0.005)
        with self.lock:
            return super().write(text)


class _Into(logging.Handler):
    def __init__(self, sink: _SlowSink):
        super().__init__(logging.INFO)
        self.sink = sink

    def emit(self, record: logging.LogRecord) -> None:
        with self.sink.lock:
            io.StringIO.write(self.sink, f"[ringtrain] {record.getMessage()}\n")


def _epochs_then_return(epochs: int) -> int:
    rank = int(os.environ["RING_RANK"])
    if rank == 0:
        spark_runner.progress(step=1, total=epochs)
        for epoch in range(1, epochs + 1):
            print(f"epoch {epoch}/{epochs}")
        spark_runner.progress(step=epochs, total=epochs)  # within 5 s: no plain line of its own
    return rank


@pytest.mark.spark
def test_every_line_rank_0_sends_before_returning_is_shown_in_order_before_the_end_line(
    spark,
):
    sink, epochs = _SlowSink(), 100
    logger = logging.getLogger("ringtrain.spark_runner")
    handler, level = _Into(sink), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        assert spark_runner.run(_epochs_then_return, args=(epochs,), num_proc=2, stdout=sink) == [
            0,
            1,
        ]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    lines = sink.getvalue().splitlines()
    shown = [line.split(":", 1)[1] for line in lines if line.startswith("[0]<stdout>:")]
    assert shown == [f"epoch {e}/{epochs}" for e in range(1, epochs + 1)]
    end = [i for i, line in enumerate(lines) if "_epochs_then_return finished on 2 ranks" in line]
    steps = [i for i, line in enumerate(lines) if line.startswith("step ")]
    first_step, last_step = steps  # the display's last line came by its flush
    assert lines[last_step].startswith(f"step {epochs}/{epochs}  ")
    last_epoch = lines.index(f"[0]<stdout>:epoch {epochs}/{epochs}")
    assert len(end) == 1 and first_step < last_epoch < last_step < end[0], lines[-5:]


def test_ranks_agree_on_an_attempt_and_one_unknown_to_the_driver_is_older_than_its_numbers():
    # The driver's numbers: the largest any rank got (Spark Connect's count lags a rank).
    assert agreed_attempt([0, 1], [7, 8], retried=True) == 1
    assert agreed_attempt([None, 2], [7, 8], retried=True) == 2
    # No rank asked the driver and the stage runs once: 0.
    assert agreed_attempt([None, None], [7, 8], retried=False) == 0
    # Under retries: below every number the driver hands out, and later attempts (their
    # tasks launched after the failed attempt's) are newer, never equal.
    first = agreed_attempt([None, None], [8, 7], retried=True)
    retry = agreed_attempt([None, None], [10, 9], retried=True)
    assert first == 7 - UNKNOWN_ATTEMPT_BASE and first < retry < 0


def test_the_log_server_keeps_an_error_line_by_reference_and_cuts_an_overlong_line():
    out = io.StringIO()
    server = LogServer(out, out)
    try:
        conn = LogConnection("127.0.0.1", server.port, server.secret, stage_id=0)
        conn.send("W", "0123456789abcdef <<blob>>")
        conn.send("O", "x" * (MAX_LINE_BYTES + 10) + "Oforged")
        conn.send("O", "[0]<stdout>:after")
        conn.close()
        assert server.drain(5.0)
        assert server.wait_for_errors(["0123456789abcdef"], 0.0) == ["<<blob>>"]
        assert server.wait_for_errors(["fedcba9876543210"], 0.0) == []  # none open: no wait
    finally:
        server.close()
    lines = out.getvalue().splitlines()
    assert [len(line) for line in lines[:-1]] == [MAX_LINE_BYTES - 1]  # cut, tag dropped
    assert lines[-1] == "[0]<stdout>:after"  # the rest of the long line was skipped
