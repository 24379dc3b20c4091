"""The op engine on real Gloo ranks: async named ops in any order, negotiation errors,
fusion, join, process sets, Adasum, timeline, stall inspector, a killed peer."""

from __future__ import annotations

import json
import os
import time

import pytest
from _reliability import record

from ringcore import WorkerError
from ringcore.testing import run_workers

DTYPES = ("float16", "float32", "float64", "int32", "int64", "uint8")


def _engine_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r, _n = hvd.rank(), hvd.size()
    out: dict = {}
    # 1. ranks submit the same names in different orders, from the main thread
    names = [f"grad.{i}" for i in range(6)]
    order = names if r % 2 == 0 else list(reversed(names))
    handles = {
        nm: hvd.allreduce_async(torch.full((3,), float(i + r)), name=nm, op=hvd.Sum)
        for i, nm in zip([names.index(x) for x in order], order)
    }
    out["orders"] = {nm: hvd.synchronize(h).tolist() for nm, h in handles.items()}
    # 2. every dtype through allreduce (Sum) and broadcast
    for d in DTYPES:
        dt = getattr(torch, d)
        out[f"sum/{d}"] = hvd.allreduce(
            torch.full((4,), r + 1, dtype=dt), op=hvd.Sum, name=f"sum.{d}"
        ).tolist()
        out[f"bcast/{d}"] = hvd.broadcast(
            torch.full((2,), r + 3, dtype=dt), root_rank=0, name=f"b.{d}"
        ).tolist()
    out["bool_min"] = hvd.allreduce(torch.tensor([True, r == 0]), op=hvd.Min).tolist()
    # 3. every mismatch kind raises on every rank, and the job goes on afterwards
    mismatches = {
        "shape": lambda: hvd.allreduce(torch.zeros(2 + r), name="m.shape"),
        "dtype": lambda: hvd.allreduce(
            torch.zeros(2, dtype=torch.float32 if r == 0 else torch.float64), name="m.dtype"
        ),
        "op": lambda: hvd.allreduce(torch.zeros(2), name="m.op", op=hvd.Sum if r == 0 else hvd.Max),
        "root": lambda: hvd.broadcast(torch.zeros(2), root_rank=r, name="m.root"),
        "kind": lambda: (
            hvd.allreduce(torch.zeros(2), name="m.kind")
            if r == 0
            else hvd.allgather(torch.zeros(2), name="m.kind")
        ),
        "allgather": lambda: hvd.allgather(torch.zeros(1, 1 + r), name="m.gather"),
    }
    for label, call in mismatches.items():
        try:
            call()
            out[f"mismatch/{label}"] = None
        except hvd.CollectiveMismatchError as exc:
            out[f"mismatch/{label}"] = str(exc)
    out["after_mismatch"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    # 4. many small async ops, synchronized at the end (fused by the engine)
    hs = [hvd.allreduce_async(torch.full((1024,), 1.0), op=hvd.Sum) for _ in range(200)]
    out["many"] = sorted({hvd.synchronize(h)[0].item() for h in hs})
    out["poll"] = hvd.poll(hvd.allreduce_async(torch.ones(1)))
    # 5. in-place async and grouped in-place
    t = torch.full((2,), float(r))
    hvd.synchronize(hvd.allreduce_async_(t, op=hvd.Sum))
    g = [torch.ones(2) * r, torch.ones(3, dtype=torch.float64) * r]
    hvd.grouped_allreduce_(g, op=hvd.Sum)
    out["inplace"] = (t.tolist(), g[0].tolist(), g[1].tolist())
    # 6. fp16 compression stays within fp16's relative error
    x = torch.linspace(-3, 3, 101) * (r + 1)
    exact = hvd.allreduce(x)
    approx = hvd.allreduce(x, compression=hvd.Compression.fp16)
    out["fp16_err"] = float(((approx - exact).abs() / exact.abs().clamp_min(1e-3)).max())
    out["fp16_dtype"] = str(approx.dtype)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request):
    return run_workers(_engine_worker, np=request.param, timeout=240)


def test_ranks_may_submit_names_in_different_orders(results):
    n = len(results)
    for res in results:
        for i in range(6):
            assert res["orders"][f"grad.{i}"] == [float(n * i + sum(range(n)))] * 3


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_dtype_allreduces_and_broadcasts(results, dtype):
    n = len(results)
    for res in results:
        assert res[f"sum/{dtype}"] == [sum(range(1, n + 1))] * 4
        assert res[f"bcast/{dtype}"] == [3, 3]
        assert res["bool_min"] == [True, n == 1]


@pytest.mark.parametrize(
    ("label", "needles"),
    [
        ("shape", ["'m.shape'", "shape", "rank 0: (2,)", "rank 1: (3,)"]),
        ("dtype", ["'m.dtype'", "dtype", "rank 0: float32", "rank 1: float64"]),
        ("op", ["'m.op'", "reduce op", "rank 0: 1", "rank 1: 4"]),
        ("root", ["'m.root'", "root rank", "rank 0: 0", "rank 1: 1"]),
        ("kind", ["'m.kind'", "op kind", "rank 0: allreduce", "rank 1: allgather"]),
        ("allgather", ["'m.gather'", "only in the first dimension"]),
    ],
)
def test_mismatch_raises_on_every_rank_naming_tensor_field_and_values(results, label, needles):
    for res in results:
        message = res[f"mismatch/{label}"]
        assert message is not None, f"rank {res} did not raise"
        for needle in needles:
            assert needle in message


def test_job_continues_after_a_mismatch(results):
    assert all(res["after_mismatch"] == len(results) for res in results)


def test_many_async_small_ops_complete_correctly(results):
    assert all(res["many"] == [float(len(results))] for res in results)
    assert all(isinstance(res["poll"], bool) for res in results)


def test_in_place_async_and_grouped_in_place(results):
    s = float(sum(range(len(results))))
    for res in results:
        assert res["inplace"] == ([s, s], [s, s], [s] * 3)


def test_fp16_compression_error_is_within_fp16_precision(results):
    for res in results:
        assert res["fp16_err"] < 2e-3
        assert res["fp16_dtype"] == "torch.float32"


def _join_worker(steps_by_rank):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r = hvd.rank()
    sums, mins = [], []
    for step in range(steps_by_rank[r]):
        sums.append(hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Sum, name=f"s{step}").item())
        mins.append(hvd.allreduce(torch.tensor([float(r + 1)]), op=hvd.Min, name=f"m{step}").item())
    last = hvd.join()
    after = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum, name="after").item()
    return sums, mins, last, after


def test_join_lets_ranks_with_more_data_go_on_with_zeros_and_returns_last_rank():
    res = run_workers(_join_worker, np=3, args=({0: 2, 1: 4, 2: 3},), timeout=120)
    sums1, mins1, _last, _after = res[1]
    assert sums1 == [6.0, 6.0, 5.0, 2.0]  # rank 0 joined after 2 steps, rank 2 after 3
    assert mins1 == [1.0, 1.0, 2.0, 2.0]  # a joined rank counts as +inf for Min
    assert [r[2] for r in res] == [1, 1, 1]
    assert all(r[3] == 3.0 for r in res)  # after everyone joined, a normal allreduce


def _process_set_worker():
    import torch

    import ringcore.torch as hvd

    evens = hvd.ProcessSet([0, 2])
    hvd.init(process_sets=[evens])
    r = hvd.rank()
    out = {"included": evens.included(), "ps_rank": evens.rank(), "ps_size": evens.size()}
    if evens.included():
        out["sum"] = hvd.allreduce(torch.tensor([float(r)]), op=hvd.Sum, process_set=evens).item()
        out["gather"] = hvd.allgather(torch.tensor([r]), process_set=evens).tolist()
    else:
        try:
            hvd.allreduce(torch.tensor([1.0]), process_set=evens)
        except ValueError as exc:
            out["outside"] = str(exc)
    out["global"] = hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item()
    try:
        hvd.add_process_set([0, 1])
    except ValueError as exc:
        out["static"] = str(exc)
    hvd.shutdown()
    hvd.init(process_sets="dynamic")
    low = hvd.add_process_set([0, 1])
    if low.included():
        out["dynamic"] = hvd.allreduce(torch.tensor([10.0]), op=hvd.Sum, process_set=low).item()
    out["removed"] = hvd.remove_process_set(low)
    return out


def test_process_sets_static_and_dynamic():
    res = run_workers(_process_set_worker, np=3, timeout=120)
    assert [r["included"] for r in res] == [True, False, True]
    assert [r["ps_rank"] for r in res] == [0, -1, 1]
    assert res[0]["sum"] == res[2]["sum"] == 2.0
    assert res[0]["gather"] == res[2]["gather"] == [0, 2]
    assert "rank 1 is not in ProcessSet([0, 2]" in res[1]["outside"]
    assert all(r["global"] == 3.0 for r in res)
    assert all("dynamic process sets" in r["static"] for r in res)
    assert res[0]["dynamic"] == res[1]["dynamic"] == 20.0 and "dynamic" not in res[2]
    assert all(r["removed"] is True for r in res)


def _adasum_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    g = torch.Generator().manual_seed(7)
    vecs = [torch.randn(50, generator=g, dtype=torch.float64) for _ in range(hvd.size())]
    mine = vecs[hvd.rank()]
    got = hvd.allreduce(mine, op=hvd.Adasum)
    try:
        hvd.allreduce(torch.ones(2, dtype=torch.int64), op=hvd.Adasum)
        int_err = None
    except TypeError as exc:
        int_err = str(exc)
    return got, vecs, int_err


def _adasum_reference(vecs):
    def pair(a, b):
        dot = float(a @ b)
        return (1 - dot / (2 * float(a @ a))) * a + (1 - dot / (2 * float(b @ b))) * b

    level = vecs
    while len(level) > 1:
        level = [pair(level[i], level[i + 1]) for i in range(0, len(level), 2)]
    return level[0]


@pytest.mark.parametrize("np_", [2, 4])
def test_adasum_equals_the_recursive_pairwise_rule(np_):
    import torch

    res = run_workers(_adasum_worker, np=np_, timeout=180)
    expected = _adasum_reference(res[0][1])
    for got, _, int_err in res:
        assert torch.allclose(got, expected, atol=1e-10)
        assert "floating-point" in int_err


def _three_rank_adasum():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    try:
        hvd.allreduce(torch.ones(2), op=hvd.Adasum)
    except ValueError as exc:
        return str(exc)


def test_adasum_on_a_non_power_of_two_raises_clearly():
    assert all("power-of-two" in m for m in run_workers(_three_rank_adasum, np=3, timeout=60))


def _timeline_worker(path):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    hs = [hvd.allreduce_async(torch.ones(256), name=f"layer{i}.grad") for i in range(8)]
    for h in hs:
        hvd.synchronize(h)
    hvd.grouped_allreduce([torch.ones(4), torch.ones(4)], name="grouped")
    hvd.allgather(torch.ones(2), name="gathered")
    hvd.broadcast(torch.ones(2), 0, name="bcast")
    hvd.shutdown()
    return path


def test_timeline_writes_chrome_trace_with_every_phase(tmp_path):
    path = tmp_path / "timeline.json"
    run_workers(
        _timeline_worker,
        np=2,
        args=(str(path),),
        # the network path: a fused allreduce there goes through a flat fusion buffer
        # (on the shared-memory plane the segment is the buffer: one ALLREDUCE phase)
        env={"RING_TIMELINE": str(path), "RING_TIMELINE_MARK_CYCLES": "1", "RING_SHM": "0"},
        timeout=90,
    )
    events = json.loads(path.read_text())
    rows = {e["args"]["name"]: e["tid"] for e in events if e.get("ph") == "M"}
    # rows are named as Horovod names its tensors: <op>.<name>
    assert {
        "allreduce.layer0.grad",
        "allreduce.grouped.0",
        "allgather.gathered",
        "broadcast.bcast",
    } <= set(rows)
    phases = {
        e["name"] for e in events if e.get("ph") == "X" and e["tid"] == rows["allreduce.grouped.0"]
    }
    assert {
        "NEGOTIATE_ALLREDUCE",
        "QUEUE",
        "MEMCPY_IN_FUSION_BUFFER",
        "ALLREDUCE",
        "MEMCPY_OUT_FUSION_BUFFER",
    } <= phases
    assert "ALLGATHER" in {e["name"] for e in events if e.get("tid") == rows["allgather.gathered"]}
    assert any(e["name"] == "CYCLE_START" for e in events)
    assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")


def _timeline_without_shutdown_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(8), name="only.grad")
    return hvd.rank()  # no shutdown(): the process's own exit path writes the timeline


def test_timeline_is_written_when_the_function_returns_without_shutdown(tmp_path):
    path = tmp_path / "timeline.json"
    run_workers(
        _timeline_without_shutdown_worker, np=2, env={"RING_TIMELINE": str(path)}, timeout=60
    )
    events = json.loads(path.read_text())
    assert "allreduce.only.grad" in {e["args"]["name"] for e in events if e.get("ph") == "M"}


def _stall_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        time.sleep(6)  # never submits "lonely"
        return "skipped"
    t0 = time.monotonic()
    try:
        hvd.allreduce(torch.ones(1), name="lonely")
        return "no error"
    except hvd.RingInternalError as exc:
        return f"{time.monotonic() - t0:.1f}|{exc}"


@pytest.mark.reliability(fault="a rank that stalls on one tensor", category="fault")
def test_stall_inspector_names_the_missing_ranks_and_can_shut_the_op_down(request):
    env = {"HOROVOD_STALL_CHECK_TIME_SECONDS": "1", "RING_STALL_SHUTDOWN_TIME_SECONDS": "3"}
    res = run_workers(_stall_worker, np=2, env=env, timeout=60)
    elapsed, message = res[0].split("|", 1)
    assert "'lonely'" in message and "ranks [1] never submitted it" in message
    assert 2.5 <= float(elapsed) < 10
    record(request, detect_s=float(elapsed), note="RING_STALL_SHUTDOWN_TIME_SECONDS=3: op failed")


def _killed_peer_worker():
    import signal

    import torch

    import ringcore.torch as hvd

    hvd.init()
    hvd.allreduce(torch.ones(1), name="warmup")
    if hvd.rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    t0 = time.monotonic()
    try:
        for i in range(100):
            hvd.allreduce(torch.ones(1000), name=f"step{i}")
            time.sleep(0.01)
        return "no error"
    except hvd.RingInternalError as exc:
        return f"{time.monotonic() - t0:.1f}|{exc}"


@pytest.mark.reliability(fault="a rank SIGKILLed between collectives", category="fault")
def test_a_killed_peer_raises_ring_internal_error_on_the_survivors_quickly(request):
    res = run_workers(_killed_peer_worker, np=3, timeout=90, return_exceptions=True)
    assert isinstance(res[2], WorkerError) and res[2].error_type == "ProcessExit"
    for survivor in res[:2]:
        elapsed, message = survivor.split("|", 1)
        assert float(elapsed) < 30
        assert "rank" in message
    record(request, detect_s=max(float(s.split("|", 1)[0]) for s in res[:2]))
    # then the survivors can re-form: shutdown() and init() again works (tested in elastic)


def _reinit_worker():
    import torch

    import ringcore.torch as hvd

    totals = []
    for _ in range(3):
        hvd.init()
        totals.append(hvd.allreduce(torch.ones(1), op=hvd.Sum).item())
        hvd.shutdown()
    return totals


def test_shutdown_then_init_again_on_every_rank():
    assert run_workers(_reinit_worker, np=2, timeout=90) == [[2.0] * 3] * 2


def _autotune_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    for _ in range(600):
        hs = [hvd.allreduce_async(torch.ones(2048), name=f"w{i}") for i in range(4)]
        for h in hs:
            hvd.synchronize(h)


def test_autotune_tries_each_candidate_and_logs_the_trials_as_csv(tmp_path):
    import csv

    log = tmp_path / "autotune.csv"
    run_workers(
        _autotune_worker,
        np=2,
        env={"RING_AUTOTUNE": "1", "RING_AUTOTUNE_LOG": str(log)},
        timeout=180,
    )
    rows = list(csv.DictReader(log.open()))
    trials = [r for r in rows if r["trial"] != "best"]
    assert len(trials) == 16
    assert {(r["fusion_threshold_bytes"], r["cycle_time_ms"]) for r in trials} == {
        (str(f), str(c))
        for f in (4 << 20, 16 << 20, 64 << 20, 128 << 20)
        for c in (0.5, 1.0, 2.5, 5.0)
    }
    best = [r for r in rows if r["trial"] == "best"]
    assert len(best) == 1 and float(best[0]["bytes_per_second"]) == max(
        float(r["bytes_per_second"]) for r in trials
    )


def test_ring_log_level_sets_the_ringtrain_loggers_and_rejects_unknown_levels(monkeypatch):
    import logging

    from ringcore.runtime import lifecycle as _runtime

    logger = logging.getLogger("ringtrain")
    before, handlers = logger.level, list(logger.handlers)
    try:
        monkeypatch.setenv("RING_LOG_LEVEL", "DEBUG")
        _runtime._apply_log_level()
        assert logger.getEffectiveLevel() == logging.DEBUG
        monkeypatch.delenv("RING_LOG_LEVEL")
        monkeypatch.setenv("HOROVOD_LOG_LEVEL", "error")  # Horovod's spelling works too
        _runtime._apply_log_level()
        assert logger.getEffectiveLevel() == logging.ERROR
        monkeypatch.setenv("RING_LOG_LEVEL", "loud")
        with pytest.raises(
            ValueError, match=r"RING_LOG_LEVEL='loud' is not a log level; use one of trace, debug"
        ):
            _runtime._apply_log_level()
    finally:
        logger.setLevel(before)
        logger.handlers[:] = handlers


@pytest.mark.parametrize(
    "make",
    [
        lambda torch: [torch.arange(n, dtype=torch.float32) + n for n in (1024, 3, 0, 7)],
        lambda torch: [torch.arange(40.0)[::2], torch.arange(9.0)[1::3]],  # strided vectors
        lambda torch: [torch.arange(12.0).view(3, 4), torch.arange(5.0), torch.ones(2, 2, 2)],
        lambda torch: [torch.arange(12.0).view(3, 4).t(), torch.arange(6.0)],  # not contiguous
    ],
    ids=["vectors", "strided-vectors", "mixed-ranks", "transposed"],
)
def test_the_fusion_buffer_round_trips_every_layout(make):
    """The engine's fusion copies (``_flatten``: one buffer in order; ``_unflatten``: views
    of it shaped like each tensor) give back every tensor's values, whichever path a
    layout takes (flat vectors are concatenated and split; the rest go through torch's
    dense-tensor flattening)."""
    import torch

    from ringcore.engine.execute import _flatten, _unflatten

    bufs = make(torch)
    flat = _flatten(bufs)
    assert flat.dim() == 1 and flat.numel() == sum(b.numel() for b in bufs)
    assert torch.equal(flat, torch.cat([b.reshape(-1) for b in bufs]))
    views = _unflatten(flat * 2, bufs)
    assert [v.shape for v in views] == [b.shape for b in bufs]
    for v, b in zip(views, bufs):
        assert torch.equal(v, b * 2)
