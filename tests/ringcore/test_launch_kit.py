"""The launcher kit of ``ringcore.launch`` on its own, with no Spark, Ray or rank process.

- the elastic job loop (``ElasticJob``) over a fake launcher — our own seam: who is
  alive, start one more, wait — a dict store and a clock the test moves;
- the limits every launcher checks once, in its own parameter names;
- the worker-error codec: a round trip, a forged blob refused, the summary;
- log forwarding: the line server's authentication, rank prefixes, progress lines,
  membership, and drain before the end.
"""

from __future__ import annotations

import contextlib
import io
import json
import socket
import time

import pytest

from ringcore import RingError, WorkerError
from ringcore.launch import (
    ElasticJob,
    ElasticNames,
    ElasticPolicy,
    LogConnection,
    LogServer,
    Workers,
    check_elastic_limits,
    decode_worker_error,
    encode_worker_error,
    late_worker_env,
    report_progress,
    signed_blob,
    stream_pair,
    worker_error_summary,
)


class _Store:
    """The three calls of ``torch.distributed.TCPStore`` the driver uses."""

    def __init__(self):
        self.data: dict[str, object] = {}

    def add(self, key: str, n: int) -> int:
        self.data[key] = int(self.data.get(key, 0)) + n  # type: ignore[call-overload]
        return int(self.data[key])  # type: ignore[call-overload]

    def set(self, key: str, value: str) -> None:
        self.data[key] = value

    def world(self, g: int) -> dict:
        return json.loads(str(self.data[f"elastic/world/{g}"]))


class _Launcher:
    """Workers by id; ``script[i]`` runs at the i-th ``wait`` (losing or finishing some)."""

    def __init__(self, ids: list[str], script=(), slots: int = 0):
        self.ids, self.script, self.slots = list(ids), list(script), slots
        self.done: set[str] = set()
        self.now = 0.0
        self.waits = self.started = 0

    def alive(self) -> Workers:
        return Workers(tuple(self.ids), tuple("h" for _ in self.ids), frozenset(self.done))

    def start_more(self) -> list[str]:
        if not self.slots:
            return []
        self.slots -= 1
        self.started += 1
        self.ids.append(f"new{self.started}")
        return [self.ids[-1]]

    def wait(self, timeout_s: float) -> None:
        self.now += timeout_s
        if self.waits < len(self.script):
            self.script[self.waits](self)
        self.waits += 1
        if self.waits > 100:
            raise AssertionError("the job never finished")

    def clock(self) -> float:
        return self.now


def _lose(wid):
    return lambda launcher: launcher.ids.remove(wid)


def _finish(*wids):
    return lambda launcher: launcher.done.update(wids)


def _job(launcher: _Launcher, store: _Store, **kwargs) -> ElasticJob:
    rules = {"grace_s": 0.0, **kwargs.pop("rules", {})}
    return ElasticJob(
        store,
        launcher.alive,
        ElasticPolicy(**rules),
        wait=launcher.wait,
        start_more=launcher.start_more,
        clock=launcher.clock,
        **kwargs,
    )


# --- the elastic job loop ------------------------------------------------------------


def test_the_job_re_forms_the_ring_on_the_survivors_and_returns_the_final_members():
    store = _Store()
    launcher = _Launcher(["a", "b", "c"], [lambda _: None, _lose("c"), _finish("a", "b")])
    seen = []
    job = _job(launcher, store, on_generation=lambda g, n: seen.append((g, n)))
    with job:
        job.start(["a", "b", "c"])
        assert job.watch() == ["a", "b"]
    assert store.world(1) == {"workers": ["a", "b"], "hosts": ["h", "h"]}
    assert seen == [(1, 2)]


def test_the_job_grows_through_start_more_up_to_max_workers():
    store = _Store()
    launcher = _Launcher(["a"], [lambda _: None, _finish("a", "new1")], slots=3)
    job = _job(launcher, store, rules={"max_workers": 2})
    job.start(["a"])
    assert job.watch() == ["a", "new1"]
    assert launcher.slots == 2  # asked once: the ring was full after that


def test_form_publishes_the_first_ring_once_the_wanted_workers_are_alive():
    store = _Store()
    launcher = _Launcher([], [lambda w: w.ids.append("x"), lambda w: w.ids.append("y")])
    job = _job(launcher, store)
    assert job.form(2, within_s=10.0, too_few=lambda n: AssertionError(n)) == ["x", "y"]
    assert store.world(1)["workers"] == ["x", "y"]


def test_form_settles_for_the_minimum_after_its_time_and_raises_the_launchers_error_below():
    launcher = _Launcher(["x"])
    job = _job(launcher, _Store(), rules={"min_workers": 1})
    assert job.form(3, within_s=1.0, too_few=lambda n: AssertionError(n)) == ["x"]
    launcher = _Launcher(["x"])
    job = _job(launcher, _Store(), rules={"min_workers": 2})
    with pytest.raises(TimeoutError, match="only 1"):
        job.form(3, within_s=1.0, too_few=lambda n: TimeoutError(f"only {n}"))
    assert launcher.now > 1.0


def test_the_job_stops_with_the_policys_reason_under_the_launchers_name():
    store = _Store()
    launcher = _Launcher(["a", "b"], [_lose("b")])
    job = _job(launcher, store, rules={"reset_limit": 0}, name="run_elastic of train")
    job.start(["a", "b"])
    with pytest.raises(RingError, match=r"run_elastic of train stopped: .*reset_limit=0"):
        job.watch()
    assert "reset_limit=0" in store.world(1)["abort"]


def test_without_stop_raises_the_job_watches_on_until_the_workers_fail_on_the_abort():
    launcher = _Launcher(["a", "b"], [_lose("b"), lambda _: None, _lose("a")])
    job = _job(launcher, _Store(), rules={"reset_limit": 0}, stop_raises=False)
    job.finished = lambda: not launcher.ids  # the launcher saw every worker fail
    job.start(["a", "b"])
    assert job.watch() == []  # the abort is the last generation: no ring
    assert job.driver.stopped and launcher.waits == 3


@pytest.mark.parametrize(
    "error, cause",
    [
        (KeyboardInterrupt(), "KeyboardInterrupt"),
        (OSError(28, "disk full"), "OSError: [Errno 28] disk full"),
    ],
)
def test_a_failure_on_the_launchers_side_publishes_an_abort_naming_it(error, cause, caplog):
    store = _Store()

    def boom(_):
        raise error

    job = _job(_Launcher(["a"], [boom]), store)
    with pytest.raises(type(error)), job:
        job.start(["a"])
        job.watch()
    assert store.world(1) == {"abort": f"the elastic job was stopped by the driver ({cause})"}
    assert "the launcher's side failed" in caplog.text and "Traceback" in caplog.text


def test_a_worker_started_late_gets_the_store_its_id_and_no_rank_of_its_own():
    env = late_worker_env("10.0.0.1", 1234, "7", secret="s3", host="10.0.0.2")
    assert env["RING_STORE_ADDR"] == "10.0.0.1" and env["RING_STORE_PORT"] == "1234"
    assert (env["RING_ELASTIC"], env["RING_ELASTIC_LATE"], env["RING_WORKER_ID"]) == (
        "1",
        "1",
        "7",
    )
    assert (env["RING_RANK"], env["RING_SIZE"], env["RING_SECRET_KEY"]) == ("0", "1", "s3")
    assert "RING_HOSTNAME" not in late_worker_env("h", 1, "0")


# --- the limits, checked once in each launcher's names --------------------------------

_SPARK = ElasticNames(min="min_num_proc", max="max_num_proc", num="num_proc")


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((0,), {"names": ElasticNames(min="min_np")}, r"^min_np must be an integer >= 1, got 0"),
        ((2, 1), {}, r"^max_workers must be None or an integer >= min_workers=2, got 1"),
        (
            (3, None),
            {"num": 2, "names": _SPARK},
            r"min_num_proc <= num_proc <= max_num_proc, got 3 <= 2 <= 2",
        ),
        (
            (None, "x"),
            {"num": None, "min_required": False, "names": _SPARK},
            r"^max_num_proc .* got 'x'",
        ),
        ((1, None, -1), {}, r"^reset_limit must be None or an integer >= 0, got -1"),
        ((1, None, None, 0), {}, r"^elastic_timeout must be > 0 seconds, got 0"),
        ((True,), {}, r"^min_workers must be an integer >= 1, got True"),
    ],
)
def test_elastic_limits_are_refused_in_the_launchers_own_names(args, kwargs, message):
    with pytest.raises(ValueError, match=message):
        check_elastic_limits(*args, **kwargs)


def test_a_launcher_may_leave_min_to_its_default_and_the_policy_may_not():
    check_elastic_limits(None, None, num=None, min_required=False, names=_SPARK)
    check_elastic_limits(None, 4, num=2, min_required=False, names=_SPARK)
    with pytest.raises(ValueError, match=r"ElasticPolicy.min_workers must be .*got None"):
        ElasticPolicy(min_workers=None)  # type: ignore[arg-type]


# --- the worker-error codec ----------------------------------------------------------

_ERR = WorkerError(
    1,
    "10.0.0.2",
    "ValueError",
    "bad shard",
    'Traceback (most recent call last):\n  File "train.py", line 9, in step\n'
    "    raise ValueError('bad shard')\nValueError: bad shard\n",
    "last output line",
)


def test_a_worker_error_survives_the_codec_with_its_rank_host_traceback_and_output():
    got = decode_worker_error(f"Job aborted: {encode_worker_error(_ERR, 'k1')}", "k1")
    assert got is not None
    assert (got.rank, got.host, got.error_type, got.message, got.traceback, got.output) == (
        _ERR.rank,
        _ERR.host,
        _ERR.error_type,
        _ERR.message,
        _ERR.traceback,
        _ERR.output,
    )


def test_the_codec_unpickles_nothing_another_secret_or_a_changed_blob_would_give():
    blob = signed_blob(_ERR, "k1")
    assert decode_worker_error(blob, "k2") is None
    assert decode_worker_error(blob, None) is None
    body = blob.rsplit(":", 2)[1]
    changed = blob.replace(body, body[:-8] + ("A" * 8 if body[-8:] != "A" * 8 else "B" * 8))
    assert decode_worker_error(changed, "k1") is None
    with pytest.raises(ValueError, match="needs the job's log secret"):
        signed_blob(_ERR, "")


def test_the_summary_names_type_rank_host_message_and_the_line_that_raised():
    summary = worker_error_summary(_ERR)
    assert summary.splitlines() == [
        "ValueError on rank 1 (10.0.0.2): bad shard",
        '  File "train.py", line 9, in step',
        "    raise ValueError('bad shard')",
    ]
    assert "k1" not in encode_worker_error(_ERR, "k1")  # the secret never travels


# --- log forwarding ------------------------------------------------------------------


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.01)


def test_the_line_server_refuses_a_peer_without_the_secret_and_writes_nothing_of_it():
    out = io.StringIO()
    server = LogServer(out, out)
    try:
        with socket.create_connection(("127.0.0.1", server.port)) as stranger:
            stranger.recv(64)  # the challenge
            stranger.sendall(b"0" * 64 + b" 0 w-9\nOforged line\n")
            _wait_for(lambda: server.refused == 1)
        wrong = LogConnection("127.0.0.1", server.port, "not the secret", 0)
        _wait_for(lambda: server.refused == 2)
        with contextlib.suppress(OSError):  # hung up on: the line goes nowhere
            wrong.send("O", "from a wrong secret")
        wrong.close()
        assert server.refused == 2 and out.getvalue() == "" and server.workers() == {}
    finally:
        server.close(drain_s=1.0)


def test_rank_prefixed_lines_progress_and_done_reach_the_driver_before_the_drain_ends():
    out, err, progress = io.StringIO(), io.StringIO(), []
    server = LogServer(out, err, attempt_of=lambda group: group + 1, on_progress=progress.append)
    try:
        conn = LogConnection("127.0.0.1", server.port, server.secret, 4, "w-1")
        assert conn.stage_attempt == 5  # the launcher's number for the worker's group
        _wait_for(lambda: "w-1" in server.workers())
        assert server.workers() == {"w-1": "127.0.0.1"}
        stdout, stderr = stream_pair(conn, 3, timestamps=False)
        stdout.write("first\nsecond")
        stderr.write("warned\n")
        stdout.close()  # the unterminated last line goes too
        report_progress(step=2, total=2, loss=0.5)  # rank 0 (no RING_RANK here)
        conn.done()
        conn.close()
        assert server.drain(5.0)
        assert out.getvalue() == "[3]<stdout>:first\n[3]<stdout>:second\n"
        assert err.getvalue() == "[3]<stderr>:warned\n"
        assert progress == [{"step": 2, "total": 2, "loss": 0.5}]
        assert server.finished() == {"w-1"} and server.workers() == {}
    finally:
        server.close(drain_s=1.0)


def test_progress_is_sent_by_rank_0_only_and_does_nothing_without_a_connection(monkeypatch):
    progress: list[dict] = []
    server = LogServer(io.StringIO(), io.StringIO(), on_progress=progress.append)
    try:
        conn = LogConnection("127.0.0.1", server.port, server.secret, 0)
        monkeypatch.setenv("RING_RANK", "1")
        report_progress(step=1, total=1)
        conn.close()
        assert server.drain(5.0) and progress == []
        report_progress(step=1, total=1)  # no connection: nothing, no error
    finally:
        server.close(drain_s=1.0)
