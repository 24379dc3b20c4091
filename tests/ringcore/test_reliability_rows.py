"""Faults the trusted systems test, injected into real Gloo ranks (``run_workers``):

- rank 0, which hosts the coordinator, SIGKILLed between or inside collectives -> every
  other rank raises ``RingInternalError`` naming rank 0 at once (its connections close);
- rank 0 hung (SIGSTOP) between or inside collectives -> the others fail after
  ``RING_CONTROL_TIMEOUT_SECONDS`` (the coordinator's heartbeat stops), or after the
  Gloo timeout and then that, naming rank 0;
- a slow rank (asleep for half the timeouts before and inside collectives, rank 0
  stopped for half of them) -> no failure, every result right;
- a control message over the 64 MiB frame limit: a request with a huge name fails that
  op alone on every rank, clearly; a raw oversized frame from a rank that passed the
  handshake ends the job, naming the rank and the cause;
- a tensor of more than 2^31 elements (slow: 2 GiB per rank) -> right results;
- a rank on another ringtrain version -> a version error on every rank, no hang;
- a rank raising in user code, or OOM-killed, while rank 0 waits in an allreduce ->
  rank 0 fails at once, naming it.

Each failing rank reports ``(error type, message, seconds from the fault)``; the fault's
time is what the faulty rank wrote to a file just before it (one clock: one machine).
"""

from __future__ import annotations

import itertools
import os
import signal
import time
from pathlib import Path

import pytest
from _reliability import record

from ringcore import WorkerError
from ringcore.testing import run_workers

WHERE = ("between collectives", "inside a collective")


def _mark(tmp: str, what: str = "fault_at") -> None:
    Path(tmp, what).write_text(repr(time.time()))


def _since(tmp: str, what: str = "fault_at") -> float:
    return time.time() - float(Path(tmp, what).read_text())


def _inside_next_backend_allreduce(action) -> None:
    """Seam: this rank's engine runs ``action()`` inside its next backend allreduce, i.e.
    once the coordinator has scheduled the op, just before the backend (Gloo) runs it."""
    from ringcore.runtime import state as st

    backend = st.engine().backend
    real = backend.allreduce

    def allreduce(t, op, group):
        backend.allreduce = real
        action()
        real(t, op, group)

    backend.allreduce = allreduce


def _when_the_others_are_inside(tmp: str, n: int, fault):
    """``fault`` once ranks 1..n-1 have entered the backend's allreduce (rank 0's
    coordinator must have sent them the op before rank 0 stops or dies)."""

    def action():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if all(Path(tmp, f"inside.{q}").exists() for q in range(1, n)):
                break
            time.sleep(0.01)
        time.sleep(0.2)  # and are inside Gloo, waiting for rank 0
        fault()

    return action


def _rank0_fault_worker(tmp: str, sig: int, where: str):
    """Rank 0 SIGKILLs or SIGSTOPs itself at step 20; the others report their error."""
    import contextlib

    import torch

    import ringcore.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    pids = hvd.allgather_object(os.getpid(), name="pids")
    x = torch.ones(1024)

    def fault():
        _mark(tmp)
        os.kill(os.getpid(), sig)

    try:
        for i in range(1000):
            if i == 20 and where == WHERE[0] and r == 0:
                fault()  # the others have finished step 19 and wait for step 20
            elif i == 20 and where == WHERE[1]:
                _inside_next_backend_allreduce(
                    _when_the_others_are_inside(tmp, n, fault)
                    if r == 0
                    else lambda: _mark(tmp, f"inside.{r}")
                )
            hvd.allreduce(x, op=hvd.Sum, name=f"step{i}")
        return ("no error", "", 0.0)
    except Exception as exc:
        elapsed = _since(tmp)
        if sig == signal.SIGSTOP:  # end the stopped rank so that the job can end
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[0], signal.SIGKILL)
        return (type(exc).__name__, str(exc), elapsed)


@pytest.mark.reliability(fault="rank 0 (the coordinator) SIGKILLed mid-training", category="fault")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", WHERE)
def test_rank_0_killed_fails_every_other_rank_at_once_naming_rank_0(tmp_path, request, where):
    timeouts = 30.0  # the failure must come from the closed connections, not a timeout
    env = {
        "RING_GLOO_TIMEOUT_SECONDS": str(timeouts),
        "RING_CONTROL_TIMEOUT_SECONDS": str(timeouts),
        # the coordinator's path: its ops reach the backend as rank 0's responses (the fast
        # lane's, run without them, fail in the shared-memory rounds: tests/ringcore/test_shm.py)
        "RING_FAST_LANE": "0",
    }
    res = run_workers(
        _rank0_fault_worker,
        np=3,
        args=(str(tmp_path), signal.SIGKILL, where),
        env=env,
        timeout=150,
        return_exceptions=True,
    )
    assert isinstance(res[0], WorkerError) and res[0].error_type == "ProcessExit", res[0]
    assert "code -9" in res[0].message
    detect = []
    for kind, message, elapsed in res[1:]:
        assert kind == "RingInternalError", message
        # closed, or reset: "the coordinator (rank 0) ... rank 0 died or shut down", "lost
        # the control connection to the coordinator (rank 0 at ...) ... its process died"
        assert "coordinator (rank 0" in message and "died" in message, message
        assert elapsed < timeouts / 3, f"detected after {elapsed:.1f} s: {message}"
        detect.append(elapsed)
    record(
        request,
        detect_s=max(detect),
        note=f"{where}: the error names the coordinator (rank 0) and that it died",
    )


@pytest.mark.reliability(fault="rank 0 (the coordinator) hung (SIGSTOP)", category="fault")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("where", WHERE)
def test_rank_0_hung_fails_every_other_rank_after_the_timeouts_naming_rank_0(
    tmp_path, request, where
):
    """A stopped rank 0 closes nothing and its coordinator stops answering. Between
    collectives the others wait for the coordinator: its heartbeat stops, and they fail
    after RING_CONTROL_TIMEOUT_SECONDS. Inside one they wait in Gloo first: after the
    data plane's timeout (Gloo's, or the shared-memory plane's for ranks on one host) they
    ask the coordinator what happened, and it stays silent as long."""
    limit = 5.0
    env = {
        "RING_GLOO_TIMEOUT_SECONDS": str(limit),
        "RING_CONTROL_TIMEOUT_SECONDS": str(limit),
        "RING_STALL_CHECK_TIME_SECONDS": "1",
        "RING_STALL_SHUTDOWN_TIME_SECONDS": str(limit),
        "RING_FAST_LANE": "0",  # the coordinator's path, as above
    }
    res = run_workers(
        _rank0_fault_worker,
        np=3,
        args=(str(tmp_path), signal.SIGSTOP, where),
        env=env,
        timeout=150,
        return_exceptions=True,
    )
    assert isinstance(res[0], WorkerError) and res[0].error_type == "ProcessExit", res[0]
    expected = limit if where == WHERE[0] else 2 * limit  # control timeout (+ Gloo's)
    detect = []
    for kind, message, elapsed in res[1:]:
        assert kind == "RingInternalError", message
        assert "rank 0" in message and "rank 0 hangs" in message, message
        assert "RING_CONTROL_TIMEOUT_SECONDS" in message, message
        if where == WHERE[1]:  # the data plane's own timeout (Gloo's "Timed out", the
            # shared-memory plane's "timed out") or rank 0's silence: the same limit, a race
            assert "timed out" in message.lower() or "has sent nothing" in message, message
        # not before the limit (nothing else can tell a stopped process), not long after
        assert limit - 1 <= elapsed < expected + 20, f"after {elapsed:.1f} s: {message}"
        detect.append(elapsed)
    record(
        request,
        detect_s=max(detect),
        note=f"{where}: RING_CONTROL_TIMEOUT_SECONDS and Gloo timeout {limit:g} s",
    )


# -- a slow peer ------------------------------------------------------------------------

SLOW_LIMIT_S = 8.0  # every timeout: Gloo, control connection, stall shutdown
SLOW_S = SLOW_LIMIT_S / 2


def _slow_peer_worker():
    """Rank 1 sleeps half the timeouts before each of two allreduces and inside one;
    then rank 0 (the coordinator) is stopped for half the timeouts while rank 1 waits
    on it. Returns every result and the longest wait."""
    import threading

    import torch

    import ringcore.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    pids = hvd.allgather_object(os.getpid(), name="pids")
    results, waits = [], []

    def step(name: str) -> None:
        t0 = time.monotonic()
        out = hvd.allreduce(torch.full((1000,), float(r + 1)), op=hvd.Sum, name=name)
        waits.append(time.monotonic() - t0)
        results.append((name, out.unique().tolist()))

    step("warmup")
    for i in range(2):  # a slow rank: late to every collective
        if r == 1:
            time.sleep(SLOW_S)
        step(f"late{i}")
    if r == 1:  # slow inside the collective: rank 0 waits inside Gloo
        _inside_next_backend_allreduce(lambda: time.sleep(SLOW_S))
    step("slow.inside")
    hvd.barrier()
    if r == 1:  # rank 0 throttled: stopped (coordinator too) while rank 1 waits on it
        os.kill(pids[0], signal.SIGSTOP)
        threading.Timer(SLOW_S, os.kill, (pids[0], signal.SIGCONT)).start()
    step("coordinator.stopped")
    step("after")
    want = float(n * (n + 1) / 2)
    wrong = [(name, got) for name, got in results if got != [want]]
    return {"results": len(results), "wrong": wrong, "longest_wait_s": max(waits)}


@pytest.mark.reliability(
    fault="a slow rank (half the timeouts) against the timeouts", category="load"
)
@pytest.mark.timeout(180)
def test_a_slow_but_alive_rank_fails_nothing_and_every_result_is_right(request):
    env = {
        "RING_GLOO_TIMEOUT_SECONDS": str(SLOW_LIMIT_S),
        "RING_CONTROL_TIMEOUT_SECONDS": str(SLOW_LIMIT_S),
        "RING_STALL_CHECK_TIME_SECONDS": "1",  # the stall shutdown is checked from 1 s on
        "RING_STALL_SHUTDOWN_TIME_SECONDS": str(SLOW_LIMIT_S),
    }
    res = run_workers(_slow_peer_worker, np=2, env=env, timeout=150)
    for out in res:
        assert out["wrong"] == [] and out["results"] == 6, out
    longest = max(out["longest_wait_s"] for out in res)
    assert longest >= SLOW_S - 0.5  # the slowness was real
    record(
        request,
        note=f"timeouts {SLOW_LIMIT_S:g} s; rank 1 slept {SLOW_S:g} s before 2 ops and inside "
        f"1, rank 0 stopped {SLOW_S:g} s: no failure, longest wait {longest:.1f} s",
    )


# -- a control message over the frame limit ---------------------------------------------


def _oversized_message_worker(tmp: str):
    import struct

    import torch

    import ringcore.torch as hvd
    from ringcore.engine.wire import MAX_MESSAGE
    from ringcore.runtime import state as st

    hvd.init()
    r = hvd.rank()
    out: dict = {}
    # 1. an op whose name alone is over the limit: refused here, never sent
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(2), name="x" * (MAX_MESSAGE + 1))
        out["huge_name"] = ("no error", "")
    except Exception as exc:
        out["huge_name"] = (type(exc).__name__, str(exc))
    out["huge_name_s"] = time.monotonic() - t0
    # 2. the job goes on
    out["after"] = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="after").tolist()
    hvd.barrier()
    # 3. a raw frame over the limit on rank 1's authenticated connection: the header
    #    alone says so; the coordinator drops rank 1 and ends the job, saying why
    if r == 1:
        eng = st.engine()
        with eng._send_lock:
            _mark(tmp)
            eng.channel.sock.sendall(struct.pack("!I", MAX_MESSAGE + 1) + b"{")
    # the job ends: an op or two may still complete first (one the fast lane runs needs no
    # coordinator) until the coordinator's abort reaches this rank
    out["raw"] = ("no error", "", 0.0)
    try:
        deadline = time.monotonic() + 20
        for i in itertools.count():
            hvd.allreduce(torch.ones(2), op=hvd.Sum, name=f"after.raw.{i}")
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
    except Exception as exc:
        out["raw"] = (type(exc).__name__, str(exc), _since(tmp))
    if r == 0:
        time.sleep(0.5)
        out["coordinator_alive"] = st.current.coordinator.thread.is_alive()
    return out


@pytest.mark.reliability(
    fault="a control message over the 64 MiB frame limit", category="bad-input", cases=2
)
@pytest.mark.timeout(180)
def test_an_oversized_control_message_is_refused_clearly_and_never_hangs(tmp_path, request):
    from ringcore.engine.wire import MAX_MESSAGE

    res = run_workers(
        _oversized_message_worker,
        np=2,
        args=(str(tmp_path),),
        env={"RING_GLOO_TIMEOUT_SECONDS": "30"},
        timeout=150,
    )
    for out in res:
        kind, message = out["huge_name"]
        assert kind == "ValueError", message
        assert f"over the limit of {MAX_MESSAGE} bytes" in message, message
        assert "a name of 67108865 characters" in message and "shorter name" in message
        assert len(message) < 500  # the name is not repeated in full
        assert out["after"] == [2.0, 2.0]
        kind, message, elapsed = out["raw"]
        assert kind == "RingInternalError", message
        assert "rank 1 sent a control message the coordinator could not read" in message
        assert f"over the limit of {MAX_MESSAGE} bytes" in message, message
        assert elapsed < 10, f"after {elapsed:.1f} s"
    assert res[0]["coordinator_alive"]  # it told every rank and still serves the others
    record(
        request,
        detect_s=max(out["raw"][2] for out in res),
        note=f"a 64 MiB name: ValueError on every rank in {max(o['huge_name_s'] for o in res):.1f} s, "
        "the job went on; a raw oversized frame: the job ended naming rank 1 and the size",
    )


# -- a tensor of more than 2^31 elements --------------------------------------------------


def _beyond_int32_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r = hvd.rank()
    n = (1 << 31) + 8
    at = [0, (1 << 31) - 1, 1 << 31, n - 2, n - 1]  # around the int32 edge, and the end
    x = torch.full((n,), r + 1, dtype=torch.uint8)
    x[n - 1] = 10 * (r + 1)
    t0 = time.monotonic()
    hvd.allreduce_(x, op=hvd.Sum, name="big.sum")  # in place: 2 GiB per rank, no copy
    summed = [int(x[i]) for i in at]
    allreduce_s = time.monotonic() - t0
    if r == 1:
        x[at[1]], x[at[2]], x[n - 1] = 7, 9, 11
    t0 = time.monotonic()
    hvd.broadcast_(x, root_rank=1, name="big.bcast")
    broadcast_s = time.monotonic() - t0
    return {
        "sum": summed,
        "bcast": [int(x[i]) for i in at],
        "allreduce_s": allreduce_s,
        "broadcast_s": broadcast_s,
    }


@pytest.mark.slow
@pytest.mark.reliability(fault="a tensor of more than 2^31 elements", category="load")
@pytest.mark.timeout(900)
def test_a_tensor_of_more_than_2_to_the_31_elements_allreduces_and_broadcasts_right(request):
    psutil = pytest.importorskip("psutil")
    need = 6 << 30  # 2 ranks x (2 GiB tensor + torch) and some room
    if psutil.virtual_memory().available < need:
        pytest.skip(f"needs {need >> 30} GiB of free memory")
    res = run_workers(_beyond_int32_worker, np=2, timeout=840)
    for out in res:
        assert out["sum"] == [3, 3, 3, 3, 30], out
        assert out["bcast"] == [3, 7, 9, 3, 11], out
    record(
        request,
        note=f"uint8 x (2^31 + 8), 2 ranks: allreduce Sum {res[0]['allreduce_s']:.0f} s, "
        f"broadcast {res[0]['broadcast_s']:.0f} s; right at 2^31 - 1, 2^31 and the end",
    )


# -- ranks on different ringtrain versions ------------------------------------------------


def _version_worker(faker: int):
    import torch

    import ringcore
    import ringcore.torch as hvd

    if int(os.environ["RING_RANK"]) == faker:
        os.environ["RING_TEST_FAKE_VERSION"] = "9.9.9"
    t0 = time.monotonic()
    where = "init"
    try:
        hvd.init()
        where = "first collective"
        hvd.allreduce(torch.ones(1), name="x")
        return ("joined", "", "", 0.0)
    except Exception as exc:
        kind = (
            "RendezvousError" if isinstance(exc, ringcore.RendezvousError) else type(exc).__name__
        )
        return (kind, str(exc), where, time.monotonic() - t0)


@pytest.mark.reliability(fault="ranks running different ringtrain versions", category="bad-input")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("faker,np_", [(1, 3), (0, 2)], ids=["rank-1-differs", "rank-0-differs"])
def test_a_rank_on_another_version_fails_every_rank_with_a_version_error(request, faker, np_):
    import ringcore

    start_timeout = 60.0  # the error must come from the check, not from a timeout
    res = run_workers(
        _version_worker,
        np=np_,
        args=(faker,),
        env={"RING_START_TIMEOUT": str(start_timeout)},
        timeout=150,
    )
    version = {r: "9.9.9" if r == faker else ringcore.__version__ for r in range(np_)}
    refused = [faker] if faker else list(range(1, np_))  # rank 0's coordinator refuses
    for r, (kind, message, where, elapsed) in enumerate(res):
        assert "install one version of ringtrain everywhere" in message, (r, message)
        for q in refused:  # every rank's message names the ranks refused and both versions
            assert f"rank {q} runs ringtrain {version[q]}" in message, (r, message)
        assert f"rank 0 runs ringtrain {version[0]}" in message, (r, message)
        if r in refused:
            assert (kind, where) == ("RendezvousError", "init"), (r, kind, where)
        else:  # init() returned before the last rank's hello; the first op fails
            assert kind == "RingInternalError", (r, kind, where)
        assert elapsed < start_timeout / 3, f"rank {r} after {elapsed:.1f} s"
    record(
        request,
        detect_s=max(e for *_, e in res),
        note=f"{'rank 1' if faker else 'rank 0'} claims 9.9.9: refused ranks fail in init(), "
        "the others at their first collective",
    )


# -- a worker that raises, or is OOM-killed, while the others wait --------------------------


def _raising_worker(tmp: str, how: str):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r = hvd.rank()
    hvd.allreduce(torch.ones(4), name="warmup")
    if r == 1:
        time.sleep(0.5)  # rank 0 is inside the allreduce by now, waiting for rank 1
        if how == "raise":
            _mark(tmp)
            raise ValueError("a bug in user code on rank 1")
        if how == "oom-kill":  # what the kernel's OOM killer does: SIGKILL, no goodbye
            hog = torch.ones(64 << 20)  # 256 MiB, touched
            _mark(tmp)
            os.kill(os.getpid(), signal.SIGKILL)
            return float(hog[0])
        import resource

        # an address-space limit a little above what the process maps: the next big
        # allocation fails with MemoryError (as under `prlimit --as`)
        with open("/proc/self/status") as f:
            vm = next(int(line.split()[1]) << 10 for line in f if line.startswith("VmSize:"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (256 << 20), resource.RLIM_INFINITY))
        _mark(tmp)
        return len(bytearray(1 << 30))
    try:
        hvd.allreduce(torch.ones(4), name="step")
        return ("no error", "", 0.0)
    except Exception as exc:
        return (type(exc).__name__, str(exc), _since(tmp))


def _rank0_failed_fast_naming_rank_1(res, gloo_timeout: float) -> float:
    kind, message, elapsed = res[0]
    assert kind == "RingInternalError", message
    assert "rank 1" in message, message
    assert elapsed < gloo_timeout / 3, f"after {elapsed:.1f} s: {message}"
    return elapsed


@pytest.mark.reliability(
    fault="a rank raising in user code while the others wait in a collective", category="fault"
)
@pytest.mark.timeout(180)
def test_a_rank_raising_while_rank_0_waits_in_an_allreduce_fails_rank_0_at_once(tmp_path, request):
    gloo_timeout = 30.0
    res = run_workers(
        _raising_worker,
        np=2,
        args=(str(tmp_path), "raise"),
        env={"RING_GLOO_TIMEOUT_SECONDS": str(gloo_timeout)},
        timeout=150,
        return_exceptions=True,
    )
    assert isinstance(res[1], WorkerError) and res[1].error_type == "ValueError", res[1]
    elapsed = _rank0_failed_fast_naming_rank_1(res, gloo_timeout)
    assert "rank 1 left the job before submitting it" in res[0][1], res[0][1]
    record(request, detect_s=elapsed, note="'rank 1 left the job before submitting it'")


@pytest.mark.reliability(fault="a rank OOM-killed while the others wait", category="fault")
@pytest.mark.timeout(180)
@pytest.mark.parametrize("how", ["oom-kill", "rlimit-as"])
def test_a_rank_out_of_memory_fails_rank_0_at_once_naming_it(tmp_path, request, how):
    gloo_timeout = 30.0
    res = run_workers(
        _raising_worker,
        np=2,
        args=(str(tmp_path), how),
        env={"RING_GLOO_TIMEOUT_SECONDS": str(gloo_timeout)},
        timeout=150,
        return_exceptions=True,
    )
    assert isinstance(res[1], WorkerError), res[1]
    if how == "oom-kill":
        assert res[1].error_type == "ProcessExit" and "code -9" in res[1].message, res[1]
        needle = "rank 1 lost its control connection (the process died"
    else:
        assert res[1].error_type == "MemoryError", res[1]
        needle = "rank 1 left the job before submitting it"
    elapsed = _rank0_failed_fast_naming_rank_1(res, gloo_timeout)
    assert needle in res[0][1], res[0][1]
    record(request, detect_s=elapsed, note=f"{how}: '{needle}'")
