"""spark_runner.run's options on real Spark: output forwarding, verbosity, GPU pinning,
cancellation, stage retries, fake hosts, and the slot wait on a local cluster."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import signal
import socket
import threading
import time

import pytest
from _reliability import record

import spark_runner
from ringcore import RingError, WorkerError, cuda_built
from ringcore.launch import LogConnection, LogServer
from spark_runner._task import gpu_env

pytestmark = pytest.mark.spark


@pytest.fixture(scope="module")
def spark():
    # local[4,3]: 4 slots, and Spark retries failed tasks (maxFailures=3); a failed
    # barrier stage is rerun at most once (two attempts), to keep failing tests short.
    session = spark_runner.local_session(
        "local[4,3]",
        app_name="test_spark_runner_options",
        conf={"spark.stage.maxConsecutiveAttempts": "2"},
    )
    try:
        yield session
    finally:
        session.stop()


def _talk(tag):
    import sys

    import ringcore

    rank = int(os.environ["RING_RANK"])
    print(f"hello {tag} from {rank}")
    print("two\nlines", file=sys.stderr)
    sys.stdout.write("no newline at the end")
    del ringcore
    return rank


def test_worker_output_reaches_the_given_file_objects_prefixed_with_rank(spark):
    out, err = io.StringIO(), io.StringIO()
    assert spark_runner.run(_talk, args=("x",), num_proc=2, stdout=out, stderr=err) == [0, 1]
    out_lines, err_lines = out.getvalue().splitlines(), err.getvalue().splitlines()
    for rank in (0, 1):
        assert f"[{rank}]<stdout>:hello x from {rank}" in out_lines
        assert f"[{rank}]<stdout>:no newline at the end" in out_lines
        assert f"[{rank}]<stderr>:two" in err_lines and f"[{rank}]<stderr>:lines" in err_lines
    assert not any("<stderr>" in line for line in out_lines)


def test_prefix_output_with_timestamp_stamps_every_line(spark):
    out = io.StringIO()
    spark_runner.run(
        _talk,
        args=("t",),
        num_proc=2,
        stdout=out,
        stderr=io.StringIO(),
        prefix_output_with_timestamp=True,
    )
    stamp = r"\w{3} \w{3} [ \d]\d \d\d:\d\d:\d\d \d{4}"
    assert re.search(rf"^{stamp}\[1\]<stdout>:hello t from 1$", out.getvalue(), re.MULTILINE)
    assert all(re.match(stamp, line) for line in out.getvalue().splitlines())


def _quiet():
    return int(os.environ["RING_RANK"])


def test_verbose_sets_how_much_the_driver_logs(spark, caplog):
    counts = {}
    for verbose in (0, 1, 2):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="ringtrain.spark_runner"):
            spark_runner.run(_quiet, num_proc=2, verbose=verbose)
        counts[verbose] = len([r for r in caplog.records if r.levelno >= logging.INFO])
    assert counts[0] == 0 < counts[1] < counts[2]
    with pytest.raises(ValueError, match="verbose must be 0"):
        spark_runner.run(_quiet, num_proc=2, verbose=-1)


def _environment():
    import sys

    return {"env": dict(os.environ), "stdout": repr(sys.stdout)}


class _KnownSecretLogServer(LogServer):
    """Seam: the job's log server, with a secret the test knows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.secret = "f00d" * 16


def test_the_log_secret_stays_out_of_the_tasks_environment(spark, monkeypatch):
    known = "f00d" * 16
    monkeypatch.setattr(spark_runner._run, "LogServer", _KnownSecretLogServer)
    results = spark_runner.run(_environment, num_proc=2)
    for res in results:
        assert not any(known in v for v in res["env"].values())
        assert known not in res["stdout"]


@pytest.mark.skipif(cuda_built(), reason="this torch has CUDA")
def test_use_gpu_without_cuda_fails_before_launch_saying_why(spark):
    with pytest.raises(RingError, match=r"use_gpu=True but .* no CUDA"):
        spark_runner.run(_quiet, num_proc=2, use_gpu=True)


class _Resource:
    def __init__(self, addresses):
        self.addresses = addresses


class _Context:  # the two things gpu_env reads from a TaskContext
    def __init__(self, resources):
        self._resources = resources

    def resources(self):
        return self._resources


def test_gpus_come_from_spark_resources_else_from_the_local_rank():
    spark_gpus = _Context({"gpu": _Resource(["3", "5"])})
    assert gpu_env(spark_gpus, None, 0) == {
        "CUDA_VISIBLE_DEVICES": "3,5",
        "RING_GPU_ADDRESSES": "3,5",
    }
    assert gpu_env(_Context({}), True, 2)["CUDA_VISIBLE_DEVICES"] == "2"
    assert gpu_env(_Context({}), None, 2) == {}
    assert gpu_env(spark_gpus, False, 0) == {}


def test_the_log_server_drops_a_peer_without_the_secret():
    out = io.StringIO()
    server = LogServer(out, out)
    try:
        with socket.create_connection(("127.0.0.1", server.port), timeout=5) as bad:
            bad.recv(64)  # the challenge
            bad.sendall(b"0" * 64 + b" 0\nOforged line\n")
            # Closed without an answer (a reset, since the forged line was left unread).
            with contextlib.suppress(ConnectionResetError):
                assert bad.recv(64) == b""
        good = LogConnection("127.0.0.1", server.port, server.secret, stage_id=0)
        good.send("O", "[0]<stdout>:real line")
        good.close()
    finally:
        server.close()
    assert out.getvalue() == "[0]<stdout>:real line\n"


def _fails_on_first_attempt(marker_dir):
    import torch

    import ringcore.torch as hvd

    attempt = int(os.environ[spark_runner.ATTEMPT_ENV_VAR])
    rank = int(os.environ["RING_RANK"])
    with open(os.path.join(marker_dir, f"rank{rank}-attempt{attempt}"), "w"):
        pass
    if attempt == 0 and rank == 0:
        raise RuntimeError("transient failure")
    hvd.init()
    return attempt, hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()


@pytest.mark.reliability(fault="a task of a barrier stage fails (Spark retry)", category="fault")
def test_a_failed_stage_is_retried_as_a_whole_with_the_attempt_number(spark, tmp_path):
    results = spark_runner.run(_fails_on_first_attempt, args=(str(tmp_path),), num_proc=2)
    assert results == [(1, 2.0), (1, 2.0)]
    assert {"rank0-attempt0", "rank0-attempt1", "rank1-attempt1"} <= set(os.listdir(tmp_path))


class _UnreachableLogServer(LogServer):
    """Seam: the tasks are told a port that refuses connections (a firewall, a Spark
    Connect client behind NAT), so no task can ask the driver for its attempt."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]  # closed again: connection refused


def _rank_0_fails_once(marker_dir):
    attempt = int(os.environ[spark_runner.ATTEMPT_ENV_VAR])
    rank = int(os.environ["RING_RANK"])
    with open(os.path.join(marker_dir, f"{rank} {attempt}"), "w"):
        pass
    failed = os.path.join(marker_dir, "failed")
    if rank == 0 and not os.path.exists(failed):
        deadline = time.monotonic() + 30
        while len(os.listdir(marker_dir)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # rank 1 has recorded its attempt too
        open(failed, "w").close()
        raise RuntimeError("transient failure")
    return attempt


@pytest.mark.reliability(
    fault="a zombie stage attempt and its retry as checkpoint writers", category="fault"
)
def test_without_the_driver_a_retried_stage_is_still_a_newer_attempt_than_the_first(
    spark, tmp_path, monkeypatch
):
    monkeypatch.setattr(spark_runner._run, "LogServer", _UnreachableLogServer)
    retry = spark_runner.run(_rank_0_fails_once, args=(str(tmp_path),), num_proc=2, verbose=0)
    seen = sorted(tuple(map(int, n.split())) for n in os.listdir(tmp_path) if n != "failed")
    first = [a for r, a in seen if a not in retry]
    # Each attempt's ranks agree; the first is below any number the driver hands out
    # (0, 1, ...) and the retry above it: never equal, as ctx.attemptNumber() (0 both
    # times) made them.
    assert len(set(retry)) == 1 and len(first) == 2 and len(set(first)) == 1, seen
    assert first[0] < retry[0] < 0


def _always_fails():
    raise KeyError(f"broken on rank {os.environ['RING_RANK']}")


def test_a_stage_that_keeps_failing_reports_the_worker_error_after_the_retries(spark):
    with pytest.raises(WorkerError) as info:
        spark_runner.run(_always_fails, num_proc=2)
    assert info.value.error_type == "KeyError" and "broken on rank" in str(info.value)


def _sleeps(pid_dir):
    with open(os.path.join(pid_dir, str(os.getpid())), "w"):
        pass
    time.sleep(60)


def _wait_for_pids(pid_dir, count, timeout=60.0, failed=()):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not failed:
        pids = [int(p) for p in os.listdir(pid_dir)]
        if len(pids) >= count:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"the tasks did not start within {timeout} s: {list(failed)}")


def _alive(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _assert_gone_within(pids, timeout):
    deadline = time.monotonic() + timeout
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a worker process outlived the cancelled run"


@pytest.mark.reliability(
    fault="the driver interrupted (spark_runner.run: Ctrl-C, job cancel)", category="fault"
)
def test_keyboard_interrupt_on_the_driver_cancels_the_stage_and_its_workers(
    spark, tmp_path, request
):
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    pids: list[int] = []
    sent: list[float] = []

    def interrupt():
        pids.extend(_wait_for_pids(str(tmp_path), 2))
        sent.append(time.monotonic())
        signal.pthread_kill(main, signal.SIGINT)

    helper = threading.Thread(target=interrupt, daemon=True)
    helper.start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        spark_runner.run(_sleeps, args=(str(tmp_path),), num_proc=2)
    helper.join(5)
    assert len(pids) == 2 and time.monotonic() - started < 50
    _assert_gone_within(pids, 15)
    record(request, recover_s=time.monotonic() - sent[0], note="Ctrl-C to every worker PID gone")


@pytest.mark.reliability(
    fault="the driver interrupted (spark_runner.run: Ctrl-C, job cancel)", category="fault"
)
def test_cancelling_from_another_thread_ends_the_run_and_its_workers(spark, tmp_path):
    outcome: list[BaseException] = []

    def call():
        try:
            spark_runner.run(_sleeps, args=(str(tmp_path),), num_proc=2)
        except BaseException as exc:
            outcome.append(exc)

    runner = threading.Thread(target=call, daemon=True)
    runner.start()
    pids = _wait_for_pids(str(tmp_path), 2, failed=outcome)
    spark.sparkContext.cancelAllJobs()
    runner.join(15)
    assert not runner.is_alive() and isinstance(outcome[0], RingError)
    assert "cancel" in str(outcome[0]).lower()
    _assert_gone_within(pids, 15)


def _topology():
    import ringcore.torch as hvd

    hvd.init()
    hvd.barrier()
    return (hvd.rank(), hvd.local_rank(), hvd.local_size(), hvd.cross_rank(), hvd.cross_size())


def test_local_and_cross_ranks_follow_the_hosts_of_the_tasks(spark, monkeypatch):
    monkeypatch.setenv(spark_runner.TOPOLOGY_HOSTS_ENV_VAR, "host-a,host-a,host-b,host-b")
    assert spark_runner.run(_topology, num_proc=4) == [
        (0, 0, 2, 0, 2),
        (1, 1, 2, 0, 2),
        (2, 0, 2, 1, 2),
        (3, 1, 2, 1, 2),
    ]
    monkeypatch.setenv(spark_runner.TOPOLOGY_HOSTS_ENV_VAR, "host-a,host-b")
    with pytest.raises(ValueError, match=r"names 2 hosts .* num_proc is 4"):
        spark_runner.run(_topology, num_proc=4)


# Last in this module: it stops the local session and starts a local cluster.
def test_start_timeout_bounds_the_wait_for_slots_on_a_cluster(spark):
    spark.stop()
    cluster = spark_runner.local_session(
        "local-cluster[2,1,1024]",
        app_name="test_spark_runner_options_cluster",
        conf={
            "spark.dynamicAllocation.enabled": "true",
            "spark.dynamicAllocation.shuffleTracking.enabled": "true",
            "spark.dynamicAllocation.minExecutors": "1",
            "spark.dynamicAllocation.maxExecutors": "2",
        },
    )
    try:
        started = time.monotonic()
        with pytest.raises(spark_runner.NotEnoughSlotsError) as info:
            spark_runner.run(_quiet, num_proc=3, start_timeout=3)
        elapsed = time.monotonic() - started
        assert 3 <= elapsed < 15
        message = str(info.value)
        assert re.search(r"needs 3 task slots but the cluster has [0-2] ", message)
        assert "Dynamic allocation is on" in message and "minExecutors" in message
    finally:
        cluster.stop()
