"""The fast lane (``ringcore.shm.vote`` and ``ringcore.engine.lane``): a blocking allreduce of
a cached name, on a one-host job whose ranks all share the shared-memory group, runs in
the caller's thread once every rank has voted for it, without the coordinator.

Real ranks (``run_workers``: spawned processes, Gloo, the shared-memory group). Each
case checks the results against values computed here, and the engine's counters say
which path the ops took; the same program with ``RING_FAST_LANE=0`` must give the same
results. The rules themselves are also checked in one process on a real segment file,
two ranks' views side by side (``flock`` excludes two open file descriptions even in one
process).
"""

from __future__ import annotations

import glob
import mmap
import os
import signal
import threading
import time
import uuid

import pytest

from ringcore import WorkerError
from ringcore.shm.vote import ABORTED, COMMITTED, GONE, H_STATE, OPEN, Votes
from ringcore.testing import run_workers

# ---- the rules, on a segment file in one process ----------------------------------------


@pytest.fixture
def two_views(tmp_path):
    """Two ranks' Votes over one 4 KiB file (header line + 2 control lines), each with its
    own open file description for the lock, as two processes would have."""
    path = tmp_path / "seg"
    path.write_bytes(bytes(4096))
    fds = [os.open(path, os.O_RDWR) for _ in range(3)]
    mm = mmap.mmap(fds[2], 4096)
    hdr = memoryview(mm)[:64].cast("q")
    ctrl = memoryview(mm)[64:192].cast("q")
    pids = {0: os.getpid(), 1: os.getpid()}
    views = [
        Votes(hdr, ctrl, r, 2, fds[r], {j: p for j, p in pids.items() if j != r}) for r in (0, 1)
    ]
    yield views, hdr, ctrl
    hdr.release()
    ctrl.release()
    mm.close()
    for fd in fds:
        os.close(fd)


def test_a_proposal_commits_when_every_rank_votes_for_the_same_op(two_views):
    (a, b), hdr, _ = two_views
    pid = a.propose(7)
    assert pid is not None and hdr[H_STATE] == OPEN
    assert b.propose(7) == pid and hdr[H_STATE] == COMMITTED
    assert a.wait(pid) and b.wait(pid)


def test_ranks_voting_for_different_ops_abort_and_neither_runs_it(two_views):
    (a, b), hdr, _ = two_views
    pid = a.propose(7)
    assert b.propose(8) is None and hdr[H_STATE] == ABORTED
    assert a.wait(pid) is False


def test_an_op_submitted_through_the_coordinator_aborts_an_open_proposal(two_views):
    (a, b), hdr, _ = two_views
    pid = a.propose(7)
    b.set_busy(1)  # b submitted an op the coordinator orders
    assert hdr[H_STATE] == ABORTED and a.wait(pid) is False
    # and while b has it in flight, no proposal opens: a must take the coordinator's path
    assert a.propose(7) is None
    b.set_busy(0)
    assert a.propose(7) is not None


def test_a_rank_that_left_aborts_the_proposal_and_no_new_one_opens(two_views):
    (a, b), hdr, ctrl = two_views
    pid = a.propose(7)
    b.leave()
    assert hdr[H_STATE] == ABORTED and a.wait(pid) is False
    assert ctrl[8 + 4] == GONE and a.propose(7) is None


def test_a_voter_waiting_for_a_late_rank_gives_up_after_its_bound(two_views):
    (a, _b), hdr, _ = two_views
    pid = a.propose(7)
    t0 = time.monotonic()
    assert a.wait(pid, give_up_s=0.1) is False
    assert 0.09 < time.monotonic() - t0 < 2.0 and hdr[H_STATE] == ABORTED


def test_a_waiter_learns_a_commit_made_by_another_thread(two_views):
    (a, b), _, _ = two_views
    pid = a.propose(3)
    later = threading.Timer(0.05, lambda: b.propose(3))
    later.start()
    try:
        assert a.wait(pid, give_up_s=5.0) is True
    finally:
        later.join()


def test_with_acks_a_commit_holds_the_next_proposal_until_each_voter_has_seen_it(two_views):
    """The host relay's rule (``acks``): a voter that went on after a commit must not open
    the next proposal before a slower voter looked, or the slower one would find another
    id in the header and take its committed batch for aborted (and send it again)."""
    (a, b), hdr, _ = two_views
    pid = a.propose(7)
    assert b.propose(7) == pid and a.wait(pid)  # b has not looked yet
    nxt = a.propose(8)
    assert nxt is not None  # without acks the next one opens at once...
    assert b.wait(pid) is False  # ...and b takes its commit for an abort
    a.acks = b.acks = True
    assert b.propose(8) == nxt and a.wait(nxt) and b.wait(nxt)
    pid = a.propose(9)
    assert pid is not None and b.propose(9) == pid and a.wait(pid)
    assert a.propose(10) is None  # held: b has not seen the commit
    assert b.wait(pid) is True  # which b still learns
    assert a.propose(10) == pid + 1 and hdr[H_STATE] == OPEN


# ---- real ranks -------------------------------------------------------------------------


def _blocking_worker(fast: str) -> dict:
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st

    os.environ["RING_FAST_LANE"] = fast
    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        out = {}
        for dt in (torch.float32, torch.float64, torch.int32, torch.bfloat16):
            for op in ("Sum", "Average", "Min", "Max"):
                if op == "Average" and not dt.is_floating_point:
                    continue
                for it in range(4):  # a name the coordinator never caches when every
                    # rank's op takes the lane; the coordinator's path caches it at once
                    x = (torch.arange(300, dtype=torch.float64) % 7 + r + it).to(dt)
                    out[f"{dt}/{op}/{it}"] = hvd.allreduce(
                        x, name=f"b.{dt}.{op}", op=getattr(hvd, op)
                    )
        for it in range(3):
            x = torch.full((5, 3), float(r + 1))
            out[f"scaled/{it}"] = hvd.allreduce(
                x, name="scaled", op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.25
            )
            y = torch.full((4,), float(r + it))
            hvd.allreduce_(y, name="inplace", op=hvd.Sum)
            out[f"inplace/{it}"] = y
        for it in range(8):  # unnamed, as most scripts write them: a counter names each
            z = torch.arange(6, dtype=torch.float64) * (r + 1) + it
            out[f"unnamed/{it}"] = hvd.allreduce(z, op=hvd.Sum)
        eng = st.current.engine
        return {
            "rank": r,
            "size": n,
            "out": {k: v.double().tolist() for k, v in out.items()},
            "fast": eng.stats["fast"],
            "fast_uncached": eng.stats["fast_uncached"],
            "votes": dict(eng.votes.stats) if eng.votes is not None else None,
        }
    finally:
        hvd.shutdown()


@pytest.mark.parametrize("np_", [2, 3])
def test_blocking_allreduces_named_or_not_take_the_fast_lane_and_match_the_coordinators_path(
    np_,
):
    fast = run_workers(_blocking_worker, np=np_, args=("1",), timeout=240)
    slow = run_workers(_blocking_worker, np=np_, args=("0",), timeout=240)
    import torch

    n = np_
    for res_fast, res_slow in zip(fast, slow):
        assert res_fast["out"] == res_slow["out"]  # bit for bit: the same arithmetic
        assert res_slow["fast"] == 0 and res_slow["votes"] is None
        # most ops ran in the fast lane (a vote a busy machine delays past its bound goes
        # the coordinator's way), the unnamed and never-cached ones too
        assert res_fast["fast"] >= 60 and res_fast["fast_uncached"] >= 50, res_fast
    # and they are right (checked against sums made here)
    for key, val in fast[0]["out"].items():
        if key.startswith("scaled/"):
            assert val == [[2.0 * sum(r + 1 for r in range(n)) * 0.25] * 3] * 5
        elif key.startswith("inplace/"):
            it = int(key.split("/")[1])
            assert val == [float(sum(r + it for r in range(n)))] * 4
        elif key.startswith("unnamed/"):
            it = int(key.split("/")[1])
            assert val == [sum(i * (r + 1) + it for r in range(n)) for i in range(6)]
        elif "/Sum/" in key and "float32" in key:
            it = int(key.split("/")[-1])
            base = torch.arange(300, dtype=torch.float64) % 7
            assert val == (sum(base + r + it for r in range(n))).tolist()


def _mixed_worker() -> dict:
    """Ranks mixing async ops through the coordinator with blocking cached ops, in an
    order that differs by rank; two threads per rank submit at once."""
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st

    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        errors: list[str] = []
        got: dict = {}

        def side(tag: str) -> None:
            try:
                for it in range(30):
                    got[f"{tag}/{it}"] = hvd.allreduce(
                        torch.full((64,), float(r + it)), name=f"side.{tag}", op=hvd.Sum
                    ).tolist()
            except Exception as exc:  # pragma: no cover - reported below
                errors.append(repr(exc))

        t = threading.Thread(target=side, args=("t",))
        t.start()
        handles = {}
        for it in range(30):
            if it % 3 == r % 3:  # rank r queues async op a.<it // 3> at its own iterations
                j = it // 3
                handles[j] = hvd.allreduce_async(
                    torch.full((8,), float(j)), name=f"a.{j}", op=hvd.Sum
                )
            got[f"blk/{it}"] = hvd.allreduce(
                torch.full((16,), float(it)), name="blk", op=hvd.Sum
            ).tolist()
        for j, h in handles.items():
            got[f"async/{j}"] = hvd.synchronize(h).tolist()
        t.join()
        return {"got": got, "errors": errors, "fast": st.current.engine.stats["fast"], "n": n}
    finally:
        hvd.shutdown()


def test_async_ops_other_threads_and_blocking_ops_in_another_order_never_mix_up():
    results = run_workers(_mixed_worker, np=2, timeout=240)
    for res in results:
        assert res["errors"] == []
        got, n = res["got"], res["n"]
        for it in range(30):
            assert got[f"blk/{it}"] == [float(it * n)] * 16
            assert got[f"t/{it}"] == [float(sum(r + it for r in range(n)))] * 64
        # the ranks queued each async op at different iterations, while blocking ops ran
        for j in range(10):
            assert got[f"async/{j}"] == [float(j * n)] * 8
    assert any(res["fast"] > 0 for res in results)


def _late_rank_worker() -> dict:
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st

    hvd.init()
    try:
        r = hvd.rank()
        x = torch.ones(32)
        for _ in range(3):
            hvd.allreduce(x, name="late", op=hvd.Sum)
        if r == 1:
            time.sleep(1.6)  # past the voter's bound: rank 0 takes the coordinator's path
        t0 = time.monotonic()
        y = hvd.allreduce(x, name="late", op=hvd.Sum)
        waited = time.monotonic() - t0
        z = hvd.allreduce(x * 3, name="late", op=hvd.Sum)  # and the lane works again
        return {
            "y": y.tolist(),
            "z": z.tolist(),
            "waited": waited,
            "aborted": st.current.engine.votes.stats["aborted"],
        }
    finally:
        hvd.shutdown()


def test_a_rank_late_past_the_voters_bound_still_gets_the_right_result():
    res = run_workers(_late_rank_worker, np=2, timeout=120)
    for r in res:
        assert r["y"] == [2.0] * 32 and r["z"] == [6.0] * 32
    assert res[0]["aborted"] >= 1 and res[0]["waited"] > 1.0


def _join_worker() -> dict:
    import torch

    import ringcore.torch as hvd

    hvd.init()
    try:
        r = hvd.rank()
        x = torch.ones(8)
        for _ in range(3):
            hvd.allreduce(x, name="j", op=hvd.Sum)
        outs = []
        if r == 0:
            last = hvd.join()
        else:
            for _ in range(4):  # rank 0 has joined: its share is zeros, as in Horovod
                outs.append(hvd.allreduce(x, name="j", op=hvd.Sum).tolist())
            last = hvd.join()
        return {"outs": outs, "last": last}
    finally:
        hvd.shutdown()


def test_blocking_ops_while_a_rank_has_joined_run_through_the_coordinator():
    res = run_workers(_join_worker, np=2, timeout=120)
    assert res[1]["outs"] == [[1.0] * 8] * 4
    assert res[0]["last"] == res[1]["last"]


def _shape_change_worker() -> dict:
    import torch

    import ringcore.torch as hvd

    hvd.init()
    try:
        r = hvd.rank()
        for _ in range(3):
            hvd.allreduce(torch.ones(6), name="s", op=hvd.Sum)
        try:
            hvd.allreduce(torch.ones(6 + r), name="s", op=hvd.Sum)  # the ranks disagree
            return {"error": None}
        except Exception as exc:
            return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        hvd.shutdown()


def test_ranks_disagreeing_on_a_cached_ops_shape_get_the_mismatch_error():
    res = run_workers(_shape_change_worker, np=2, timeout=120)
    for r in res:
        assert r["error"] is not None and "shape" in r["error"].lower(), r


def _first_op_mismatch_worker() -> dict:
    """Ranks that disagree on an op the coordinator has never seen: a new name's shape, an
    unnamed op's reduction. Each proposes another key, so the lane is not taken and the
    coordinator compares the requests field by field."""
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st

    hvd.init()
    errors = {}
    try:
        r = hvd.rank()
        cases = {
            "shape": lambda: hvd.allreduce(torch.ones(6 + r), name="new", op=hvd.Sum),
            "op": lambda: hvd.allreduce(torch.ones(3), op=hvd.Max if r else hvd.Sum),
            "dtype": lambda: hvd.allreduce(
                torch.ones(3, dtype=torch.float64 if r else torch.float32)
            ),
        }
        for case, call in cases.items():
            try:
                call()
                errors[case] = None
            except Exception as exc:
                errors[case] = f"{type(exc).__name__}: {exc}"
        ok = hvd.allreduce(torch.full((2,), float(r)), op=hvd.Sum)  # and the job goes on
        return {"errors": errors, "ok": ok.tolist(), "fast": st.current.engine.stats["fast"]}
    finally:
        hvd.shutdown()


def test_ranks_disagreeing_on_a_new_or_unnamed_op_get_the_mismatch_error_naming_the_field():
    res = run_workers(_first_op_mismatch_worker, np=2, timeout=120)
    for r in res:
        for field, error in r["errors"].items():
            assert error is not None and error.startswith("CollectiveMismatchError"), r
            assert field in error.lower(), (field, error)
        assert r["ok"] == [1.0, 1.0]


def _killed_in_lane_worker() -> dict:
    import torch

    import ringcore.torch as hvd

    hvd.init()
    x = torch.ones(16)
    for _ in range(5):
        hvd.allreduce(x, name="k", op=hvd.Sum)
    if hvd.rank() == 1:
        time.sleep(0.3)  # rank 0 is waiting for this rank's vote
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for _ in range(5):
            hvd.allreduce(x, name="k", op=hvd.Sum)
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0}


def test_a_rank_sigkilled_while_its_peer_waits_for_its_vote_fails_the_peer_fast():
    prefix = f"fastlane-{uuid.uuid4().hex[:10]}"
    res = run_workers(
        _killed_in_lane_worker,
        np=2,
        env={"RING_STORE_PREFIX": prefix},
        timeout=120,
        return_exceptions=True,
    )
    assert isinstance(res[1], WorkerError)
    assert res[0]["error"] is not None and "rank 1" in res[0]["error"], res[0]
    assert res[0]["after_s"] < 2.3  # 0.3 s before the kill, then < 2 s
    assert glob.glob(f"/dev/shm/ringshm-{prefix}*") == []


def _burst_worker() -> dict:
    """Bursts of async allreduces, submitted in a different order on each rank, then
    waited on: the whole burst is one batch of the lane. Then bursts that differ between
    the ranks when the first wait comes, and an op nobody waits on (polled)."""
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st

    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        eng = st.current.engine
        order = list(range(120))
        if r % 2:
            order.reverse()
        results = []
        for it in range(4):
            hs = {
                i: hvd.allreduce_async(
                    torch.full((i % 7 + 1,), float(i + r + it)), name=f"burst.{i}", op=hvd.Sum
                )
                for i in order
            }
            results.append({i: hvd.synchronize(h).tolist() for i, h in sorted(hs.items())})
        fast_bursts = eng.stats["fast"]
        # the ranks' batches differ at the first wait: rank 0 has one op more queued
        extra = None
        if r == 0:
            extra = hvd.allreduce_async(torch.ones(3), name="uneven.extra", op=hvd.Sum)
        h = hvd.allreduce_async(torch.ones(5), name="uneven.main", op=hvd.Sum)
        uneven = hvd.synchronize(h).tolist()
        if r != 0:
            extra = hvd.allreduce_async(torch.ones(3), name="uneven.extra", op=hvd.Sum)
        extra_out = hvd.synchronize(extra).tolist()
        # an op nobody waits on still completes (the sender sends it)
        p = hvd.allreduce_async(torch.ones(2), name="polled", op=hvd.Sum)
        t0 = time.monotonic()
        while not hvd.poll(p):
            assert time.monotonic() - t0 < 30, "a polled op never completed"
            time.sleep(0.001)
        return {
            "results": results,
            "n": n,
            "fast_bursts": fast_bursts,
            "uneven": uneven,
            "extra": extra_out,
            "polled": hvd.synchronize(p).tolist(),
        }
    finally:
        hvd.shutdown()


def test_async_bursts_in_different_orders_run_as_one_batch_and_uneven_ones_still_agree():
    res = run_workers(_burst_worker, np=2, timeout=240)
    for out in res:
        n = out["n"]
        for it, burst in enumerate(out["results"]):
            for i, val in burst.items():
                assert val == [float(sum(i + r + it for r in range(n)))] * (i % 7 + 1)
        assert out["uneven"] == [float(n)] * 5 and out["extra"] == [float(n)] * 3
        assert out["polled"] == [float(n)] * 2
    # the first burst is negotiated in full; most later ones take the lane whole
    assert any(out["fast_bursts"] >= 120 for out in res)


def _gc_pause_worker() -> dict:
    """Bursts of async allreduces with a full garbage collection in the middle of each
    (the submitting thread holds the GIL through it, tens of ms: far past LANE_IDLE_S),
    then every op waited on."""
    import gc

    import torch

    import ringcore.torch as hvd
    from ringcore.engine.lane import LANE_IDLE_S
    from ringcore.runtime import state as st

    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        heap = [[i] for i in range(800_000)]  # a collection of this heap takes a while
        xs = [torch.zeros(4) for _ in range(200)]
        pauses, fast, sums = [], [], []
        for it in range(5):
            for x in xs:
                x.fill_(float(r + it))
            fast0 = st.current.engine.stats["fast"]
            hs = [
                hvd.allreduce_async_(x, name=f"gc.{i}", op=hvd.Sum) for i, x in enumerate(xs[:100])
            ]
            t0 = time.perf_counter()
            gc.collect()
            pauses.append(time.perf_counter() - t0)
            hs += [
                hvd.allreduce_async_(x, name=f"gc.{i + 100}", op=hvd.Sum)
                for i, x in enumerate(xs[100:])
            ]
            for h in hs:
                hvd.synchronize(h)
            fast.append(st.current.engine.stats["fast"] - fast0)
            sums.append(sorted({x[0].item() for x in xs}))
        del heap
        return {"n": n, "pauses": pauses, "fast": fast, "sums": sums, "idle": LANE_IDLE_S}
    finally:
        hvd.shutdown()


def test_a_garbage_collection_mid_burst_does_not_send_the_burst_away_from_the_lane():
    """The sender thread sends queued ops to the coordinator once none was queued for
    LANE_IDLE_S; a pause of the submitting thread that holds the GIL (a full collection:
    about 86 ms in a process with torch imported, here) must not count as that idle
    time. It did, and every such burst lost the fast lane (a round trip through the
    coordinator: about 100 ms more for 1,000 ops)."""
    res = run_workers(_gc_pause_worker, np=2, timeout=240)
    for out in res:
        n = out["n"]
        assert out["sums"] == [[float(sum(r + it for r in range(n)))] for it in range(5)]
        assert min(out["pauses"]) > 2 * out["idle"], out["pauses"]  # the pause was long
    # the first burst is negotiated in full (names not cached yet); the others whole
    for out in res:
        assert out["fast"][1:] == [200] * 4, out["fast"]


def _slow_backward_worker() -> dict:
    """A model whose backward leaves 30 ms between two gradients (far past LANE_IDLE_S,
    as the large layers of a real model do), trained with DistributedOptimizer; then a
    gradient-like op that nobody waits on, polled."""
    import time

    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st
    from ringcore.torch._async import _allreduce_start

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            time.sleep(0.03)
            return g

    hvd.init()
    try:
        r = hvd.rank()
        torch.manual_seed(0)
        first, last = torch.nn.Linear(6, 8), torch.nn.Linear(8, 2)
        params = [*first.parameters(), *last.parameters()]
        opt = hvd.DistributedOptimizer(
            torch.optim.SGD(params, lr=1e-3),
            named_parameters=[(f"p{i}", p) for i, p in enumerate(params)],
        )
        x = torch.arange(24, dtype=torch.float32).reshape(4, 6) / (10 + r)
        eng = st.current.engine
        fast0 = eng.stats["fast"]
        for _ in range(4):
            opt.zero_grad()
            last(Slow.apply(first(x))).square().sum().backward()
            opt.step()
        fast = eng.stats["fast"] - fast0
        t0 = time.monotonic()
        h = _allreduce_start(torch.ones(3), None, "never.waited", hvd.Sum, 1.0, 1.0,
                             hvd.global_process_set, inplace=True, now=False, held=True)  # fmt: skip
        while not hvd.poll(h):
            time.sleep(0.01)
        left_after = time.monotonic() - t0
        return {
            "fast": fast,
            "weights": [p.detach().tolist() for p in params],
            "polled": hvd.synchronize(h).tolist(),
            "left_after": left_after,
        }
    finally:
        hvd.shutdown()


def test_gradients_of_a_backward_with_long_gaps_take_the_fast_lane_and_unwaited_ones_still_leave():
    from ringcore.engine.submit import HOLD_MAX_S

    res = run_workers(_slow_backward_worker, np=2, timeout=120)
    for r in res:
        # all 4 gradients of each of 4 steps: the first ones, queued 30 ms before the
        # last, are held for step()'s wait instead of sent to the coordinator
        assert r["fast"] == 16, r
        assert r["polled"] == [2.0] * 3
        assert r["left_after"] < HOLD_MAX_S + 5, r  # a held op nobody waits on still runs
    assert res[0]["weights"] == res[1]["weights"]


def _fused_worker(shm: str) -> dict:
    """Fused batches through the segment's slot (``ShmGroup.allreduce_list_``) against
    the same ops on Gloo (flattened): in-place and new-tensor results, Average and
    scale factors, a tensor spanning several chunks of a 16 KiB slot, integers."""
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st
    from ringcore.shm.layer import ShmBackend

    ShmBackend.slot_bytes = 16 << 10
    os.environ["RING_SHM"] = shm
    hvd.init()
    try:
        r = hvd.rank()
        out = {}
        for it in range(3):
            for dt in (torch.float32, torch.int32):
                sizes = [5, 300, 9000, 1, 64]
                xs = [((torch.arange(n) % 5) + r + it).to(dt) for n in sizes]
                ops = [("Sum", 1.0, 1.0), ("Sum", 2.0, 0.5)]
                if dt.is_floating_point:
                    ops.append(("Average", 1.0, 1.0))
                for op, pre, post in ops:
                    key = f"{dt}/{op}/{pre}"
                    hs = [
                        hvd.allreduce_async(
                            x,
                            name=f"f.{key}.{k}",
                            op=getattr(hvd, op),
                            prescale_factor=pre,
                            postscale_factor=post,
                        )
                        for k, x in enumerate(xs)
                    ]
                    ins = [x.clone() for x in xs]
                    hs_in = [
                        hvd.allreduce_async_(
                            x,
                            name=f"i.{key}.{k}",
                            op=getattr(hvd, op),
                            prescale_factor=pre,
                            postscale_factor=post,
                        )
                        for k, x in enumerate(ins)
                    ]
                    outs = [hvd.synchronize(h) for h in hs] + [hvd.synchronize(h) for h in hs_in]
                    assert all(
                        torch.equal(a, b)
                        for a, b in zip(
                            xs, [((torch.arange(n) % 5) + r + it).to(dt) for n in sizes]
                        )
                    )  # inputs untouched
                    out[f"{key}/{it}"] = [o.tolist() for o in outs]
        backend = st.current.engine.backend
        return {
            "out": out,
            "stats": dict(getattr(backend, "stats", {})),
            "in_slot": st.current.engine.stats["ops_in_slot"],
        }
    finally:
        hvd.shutdown()


def test_fused_batches_through_the_segments_slot_match_gloos_flattened_results():
    on = run_workers(_fused_worker, np=3, args=("1",), timeout=240)
    off = run_workers(_fused_worker, np=3, args=("0",), timeout=240)
    for a, b in zip(on, off):
        assert a["out"] == b["out"]
        assert a["stats"]["network"] == 0 and a["stats"]["shm"] > 0
        assert a["in_slot"] >= 3 * 5 * 2 * 5 and b["in_slot"] == 0


def _timeline_burst_worker() -> list:
    import torch

    import ringcore.torch as hvd

    hvd.init()
    try:
        r = hvd.rank()
        out = []
        for _ in range(3):
            hs = [
                hvd.allreduce_async(torch.full((9,), float(r + i)), name=f"tl.{i}")
                for i in range(6)
            ]
            out.append([hvd.synchronize(h).tolist() for h in hs])
        return out
    finally:
        hvd.shutdown()


def test_a_timeline_on_rank_0_only_does_not_split_the_ranks_between_paths(tmp_path):
    """Only rank 0 writes the timeline: nothing the ranks route by may depend on it (a
    fused Average once went through the segment on one rank and not the other)."""
    res = run_workers(
        _timeline_burst_worker,
        np=2,
        env={"RING_TIMELINE": str(tmp_path / "t.json")},
        timeout=120,
    )
    for out in res:
        for burst in out:
            assert burst == [[float(i) + 0.5] * 9 for i in range(6)]  # Average of r + i


def _uneven_threshold_worker() -> dict:
    """Rank 1 starts with a fusion threshold of 64 bytes, rank 0 with the default: bursts
    of cached async allreduces, which take the fast lane."""
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st

    if os.environ.get("RING_RANK") == "1":
        os.environ["RING_FUSION_THRESHOLD"] = "64"
    hvd.init()
    try:
        r, n = hvd.rank(), hvd.size()
        xs = [torch.zeros(16) for _ in range(8)]
        sums = []
        for it in range(6):
            for i, x in enumerate(xs):
                x.fill_(float(r + i + it))
            hs = [hvd.allreduce_async_(x, name=f"thr.{i}", op=hvd.Sum) for i, x in enumerate(xs)]
            for h in hs:
                hvd.synchronize(h)
            sums.append([x[0].item() for x in xs])
        eng = st.current.engine
        return {"n": n, "sums": sums, "fast": eng.stats["fast"], "thr": eng.fusion_threshold}
    finally:
        hvd.shutdown()


@pytest.mark.reliability(
    fault="ranks started with different RING_FUSION_THRESHOLD values", category="bad-input"
)
def test_ranks_with_different_fusion_thresholds_fuse_the_lanes_batches_alike():
    """The coordinator fuses with rank 0's threshold; the fast lane used each rank's own,
    so ranks whose environments differed built different fusions of one batch and the
    lane's shared-memory allreduce failed on the descriptors. Rank 0's threshold now
    reaches every rank at start-up."""
    res = run_workers(_uneven_threshold_worker, np=2, timeout=120)
    for out in res:
        n = out["n"]
        for it, sums in enumerate(out["sums"]):
            assert sums == [float(sum(r + i + it for r in range(n))) for i in range(8)]
        assert out["thr"] == res[0]["thr"]  # rank 0's value on every rank
    assert all(out["fast"] > 0 for out in res)  # the later bursts took the lane


# ---- across hosts: the host relay -------------------------------------------------------


def _relay_worker() -> dict:
    """Two faked hosts of two ranks: blocking ops (named, unnamed), async ops queued in
    another order by each rank, a new op the two ranks of host a disagree on, and a rank
    of host b late past its host's vote bound."""
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st

    hvd.init()
    try:
        r = hvd.rank()
        got: dict = {}
        for it in range(6):
            got[f"named/{it}"] = hvd.allreduce(
                torch.full((300,), float(r + it)), name="w", op=hvd.Sum
            ).tolist()
            got[f"unnamed/{it}"] = hvd.allreduce(
                torch.arange(5, dtype=torch.float64) * (r + 1) + it, op=hvd.Average
            ).tolist()
        names = [f"a.{j}" for j in range(4)]
        order = names if r % 2 == 0 else names[::-1]
        handles = {
            nm: hvd.allreduce_async(torch.full((8,), float(r + int(nm[2:]))), name=nm, op=hvd.Sum)
            for nm in order
        }
        for nm in names:
            got[nm] = hvd.synchronize(handles[nm]).tolist()
        try:
            hvd.allreduce(torch.ones(4 + (r == 1)), name="bad", op=hvd.Sum)
            got["bad"] = None
        except Exception as exc:
            got["bad"] = f"{type(exc).__name__}: {exc}"
        if r == 3:
            time.sleep(1.3)  # its host's peer gives up its vote and sends its own request
        got["late"] = hvd.allreduce(torch.full((3,), float(r)), name="late", op=hvd.Sum).tolist()
        eng, coord = st.current.engine, st.current.coordinator
        return {
            "got": got,
            "relay": eng.relay_ranks,
            "relayed": eng.stats["relayed"],
            "fast": eng.stats["fast"],
            "coord": dict(coord.stats) if coord is not None else None,
        }
    finally:
        hvd.shutdown()


def test_across_hosts_each_hosts_leader_sends_the_requests_its_ranks_agreed_on():
    res = run_workers(_relay_worker, np=4, hosts=["a", "a", "b", "b"], timeout=180)
    n = 4
    for r, out in enumerate(res):
        got = out["got"]
        assert out["relay"] == ((0, 1) if r < 2 else (2, 3)) and out["fast"] == 0
        for it in range(6):
            assert got[f"named/{it}"] == [float(sum(q + it for q in range(n)))] * 300
            mean = [sum(i * (q + 1) + it for q in range(n)) / n for i in range(5)]
            assert got[f"unnamed/{it}"] == pytest.approx(mean)
        for j in range(4):
            assert got[f"a.{j}"] == [float(sum(q + j for q in range(n)))] * 8
        # the coordinator still compares the requests field by field, on every rank
        assert got["bad"] is not None and got["bad"].startswith("CollectiveMismatchError")
        assert "shape" in got["bad"].lower()
        assert got["late"] == [float(sum(range(n)))] * 3
        # most blocking ops went through the host's leader (a vote a busy machine delays
        # past its bound goes the rank's own way)
        assert out["relayed"] >= 9, out
    coord = res[0]["coord"]
    assert coord["relayed_frames"] >= 9 and coord["request_frames"] > coord["relayed_frames"]


def test_the_coordinator_refuses_a_batch_sent_for_ranks_the_sender_does_not_lead():
    """A seam of ours: the coordinator's check of a relayed batch's ranks, on a stand-in
    for its state (the job's size, and what an abort would tell every rank)."""
    from types import SimpleNamespace

    from ringcore.engine.coordinator import Coordinator

    aborted: list[str] = []
    job = SimpleNamespace(cfg=SimpleNamespace(size=4), _abort=aborted.append)
    assert Coordinator._relayed_for(job, 2, (2, 3)) == (2, 3) and not aborted
    assert Coordinator._relayed_for(job, 3, (2, 3)) == (2, 3) and not aborted
    bad = [(2, (0, 1)), (2, (3, 2)), (2, (2, 3, 4)), (0, (0, "1")), (0, (0, True)), (0, ())]
    for sender, ranks in bad:
        assert Coordinator._relayed_for(job, sender, ranks) is None
        assert f"rank {sender} sent requests for ranks" in aborted.pop()
