"""The engine's shared-memory data plane (``ringcore.shm.layer``) on 2, 3 and 4 real
ranks of one host.

One launch per rank count runs a matrix of every collective x dtype through the
public API twice in the same processes: with ``RING_SHM=1`` (the engine picks the
shared-memory group) and, after ``shutdown()`` and a fresh ``init()``, with
``RING_SHM=0`` (Gloo). Inputs are small integers in every dtype, so each sum,
product and average is exact and the two paths must agree bit for bit. Slots of
16 KiB make the larger tensors span several chunks.
"""

from __future__ import annotations

import glob
import logging
import os
import signal
import time
import uuid

import pytest

from ringcore import WorkerError
from ringcore.shm.layer import plan
from ringcore.testing import run_workers

DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64", "uint8", "int8", "bool")
OPS = ("Sum", "Average", "Min", "Max", "Product")
SIZES = (7, 20_001)  # the one-barrier path, and chunks of a 16 KiB slot


def _input(dt, r: int, numel: int, salt: int = 0):
    import torch

    k = torch.arange(numel, dtype=torch.int64) * (r + 1 + salt)
    if dt == torch.bool:
        return (k + r) % 3 == 0
    if dt == torch.uint8:
        return (k % 3).to(dt)
    return (k % 5 - 2).to(dt)  # -2..2: sums, products and averages stay exact


def _matrix(hvd, torch) -> dict:
    """Every op x dtype through the engine: key -> result (tensors)."""
    r, n = hvd.rank(), hvd.size()
    out: dict = {}
    for name in DTYPES:
        dt = getattr(torch, name)
        ops = ("Min", "Max") if dt == torch.bool else OPS
        for numel in SIZES:
            for op in ops:
                out[f"allreduce/{name}/{op}/{numel}"] = hvd.allreduce(
                    _input(dt, r, numel), op=getattr(hvd, op)
                )
        if dt != torch.bool:
            out[f"scaled/{name}"] = hvd.allreduce(
                _input(dt, r, 33), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5
            )
            out[f"fused/{name}"] = hvd.grouped_allreduce(
                [_input(dt, r, 5, s) for s in range(3)] + [_input(dt, r, 9000).view(3, 3000)],
                op=hvd.Sum,
            )
            out[f"reducescatter/{name}"] = hvd.reducescatter(
                _input(dt, r, 2 * (2 * n + 1)).view(2 * n + 1, 2), op=hvd.Sum
            )
        out[f"allgather/{name}"] = hvd.allgather(_input(dt, r, 3 * (r + 1) * 700).view(-1, 3))
        out[f"broadcast/{name}"] = hvd.broadcast(_input(dt, r, 5001), root_rank=n - 1)
        splits = [j + 1 for j in range(n)]  # rank j gets j+1 rows of 2000 from every rank
        out[f"alltoall/{name}"] = hvd.alltoall(
            _input(dt, r, sum(splits) * 2000).view(-1, 2000), splits=splits
        )
        hvd.barrier()
    out.update(_out_of_order(hvd, torch))
    return out


def _out_of_order(hvd, torch) -> dict:
    """Named async ops submitted in a different order on every rank."""
    r = hvd.rank()
    names = [f"ooo.{k}" for k in range(6)]
    order = names[r % len(names) :] + names[: r % len(names)]
    if r % 2:
        order.reverse()
    handles = {}
    for name in order:
        k = int(name.split(".")[1])
        x = _input(torch.float32, r, 100 + 5000 * k)
        handles[name] = (
            hvd.allgather_async(x.view(-1, 1), name=name)
            if k % 3 == 2
            else hvd.allreduce_async(x, name=name, op=hvd.Sum)
        )
    return {f"async/{name}": hvd.synchronize(handles[name]) for name in names}


def _run_matrix(shm: str) -> tuple[dict, dict]:
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st
    from ringcore.shm.layer import ShmBackend

    ShmBackend.slot_bytes = 16 << 10
    os.environ["RING_SHM"] = shm
    hvd.init()
    try:
        out = _matrix(hvd, torch)
        backend = st.current.engine.backend
        facts = {
            "class": type(backend).__name__,
            "name": backend.name,
            "mode": getattr(backend, "mode", None),
            "stats": dict(getattr(backend, "stats", {})),
        }
    finally:
        hvd.shutdown()
    return out, facts


def _both_modes_worker() -> dict:
    import torch

    shm_out, shm_facts = _run_matrix("1")
    net_out, net_facts = _run_matrix("0")
    assert shm_out.keys() == net_out.keys()

    def same(a, b) -> bool:
        if isinstance(a, list | tuple):
            return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)

    r, n = int(os.environ["RING_RANK"]), int(os.environ["RING_SIZE"])
    ref = sum(_input(torch.int64, j, 20_001) for j in range(n))  # a reference of our own
    return {
        "keys": len(shm_out),
        "differ": sorted(k for k in shm_out if not same(shm_out[k], net_out[k])),
        "sum_matches_reference": torch.equal(shm_out["allreduce/int64/Sum/20001"], ref),
        "shm": shm_facts,
        "net": net_facts,
        "rank": r,
    }


@pytest.fixture(scope="module", params=[2, 3, 4], ids=["2ranks", "3ranks", "4ranks"])
def both_modes(request):
    return run_workers(_both_modes_worker, np=request.param, timeout=400)


def test_every_op_and_dtype_gives_the_same_result_through_shm_as_through_gloo(both_modes):
    for res in both_modes:
        assert res["keys"] > 9 * 14
        assert res["differ"] == [], f"rank {res['rank']}"
        assert res["sum_matches_reference"]


def test_the_engine_moves_every_cpu_op_of_the_world_through_shared_memory(both_modes):
    for res in both_modes:
        shm, net = res["shm"], res["net"]
        assert (shm["class"], shm["mode"], shm["name"]) == ("ShmBackend", "flat", "gloo")
        assert shm["stats"]["network"] == 0
        assert shm["stats"]["shm"] >= res["keys"] - 1  # some keys share one fused op
        assert net["class"] != "ShmBackend" and net["name"] == "gloo"


# ---- failures -----------------------------------------------------------------------------


def _dying_worker() -> dict:
    import torch

    import ringcore.torch as hvd

    hvd.init()
    x = torch.ones(300_000)
    hvd.allreduce(x, op=hvd.Sum)
    if hvd.rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # rank 0 is already in the next allreduce
    t0 = time.monotonic()
    try:
        for _ in range(50):
            hvd.allreduce(x, op=hvd.Sum)
        return {"error": None}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "after_s": time.monotonic() - t0}


def test_a_rank_sigkilled_in_an_shm_allreduce_fails_the_other_fast_and_leaves_no_segment():
    prefix = f"shmeng-{uuid.uuid4().hex[:10]}"
    results = run_workers(
        _dying_worker,
        np=2,
        env={"RING_STORE_PREFIX": prefix},
        timeout=120,
        return_exceptions=True,
    )
    assert isinstance(results[1], WorkerError) and "ProcessExit" in str(results[1])
    assert results[0]["error"] is not None and "rank 1" in results[0]["error"]
    assert results[0]["after_s"] < 2.0
    assert glob.glob(f"/dev/shm/ringshm-{prefix}*") == []


def _no_room_worker() -> dict:
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as st
    from ringcore.shm.group import ShmGroup

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                records.append(record.getMessage())

    logging.getLogger("ringtrain").addHandler(Keep())
    ShmGroup.free_space = staticmethod(lambda path: 1 << 20)  # 1 MiB: too small
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    total = hvd.allreduce(torch.arange(10_000.0) * (r + 1), op=hvd.Sum)
    gathered = hvd.allgather(torch.tensor([r]))
    return {
        "class": type(st.current.engine.backend).__name__,
        "right": torch.equal(total, torch.arange(10_000.0) * (n * (n + 1) // 2))
        and gathered.tolist() == list(range(n)),
        "warnings": records,
    }


def test_too_small_dev_shm_falls_back_to_the_network_with_one_warning():
    results = run_workers(_no_room_worker, np=2, timeout=120)
    assert [res["class"] for res in results] == ["HostStaged", "HostStaged"]
    assert all(res["right"] for res in results)
    (line,) = [w for res in results for w in res["warnings"]]
    assert "has 1 MiB free" in line and "--shm-size" in line and "RING_SHM=0" in line


# ---- the plan (pure) ----------------------------------------------------------------------


def _facts(hosts: list[str]) -> list[tuple[str, int, int]]:
    return [(h, hosts[:r].count(h), hosts.count(h)) for r, h in enumerate(hosts)]


def test_plan_is_flat_on_one_host_and_off_with_ring_shm_0_or_one_rank_per_host():
    assert plan(1, _facts(["a", "a", "a"]), shm=True, hierarchical=None).mode == "flat"
    assert plan(1, _facts(["a", "a"]), shm=False, hierarchical=None).mode == "off"
    assert plan(1, _facts(["a", "b"]), shm=True, hierarchical=True).mode == "off"


def test_plan_is_hierarchical_on_homogeneous_host_major_hosts_unless_told_not_to():
    p = plan(3, _facts(["a", "a", "b", "b"]), shm=True, hierarchical=None)
    assert (p.mode, p.local, p.host, p.cross) == ("hierarchical", (2, 3), 1, ((0, 2), (1, 3)))
    assert plan(3, _facts(["a", "a", "b", "b"]), shm=True, hierarchical=False).mode == "off"


@pytest.mark.parametrize(
    ("hosts", "why"),
    [
        (["a", "a", "b"], "different numbers of ranks"),
        (["a", "b", "a", "b"], "not numbered host by host"),
    ],
)
def test_plan_keeps_the_flat_ring_on_other_topologies(hosts, why):
    p = plan(0, _facts(hosts), shm=True, hierarchical=True)
    assert p.mode == "off" and why in p.reason


def test_plan_refuses_a_topology_the_hosts_contradict():
    facts = _facts(["a", "a"])
    facts[1] = ("a", 0, 2)  # two ranks both say local rank 0
    p = plan(0, facts, shm=True, hierarchical=None)
    assert p.mode == "off" and "rank 1 says local rank 0 of 2" in p.reason
