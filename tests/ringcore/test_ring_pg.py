"""The torch.distributed backend "ring" (ringcore.dist_backend): each collective it
carries through shared memory gives Gloo's result on the same inputs; DDP and FSDP2
train over it as over Gloo; two (faked) hosts of two ranks run the same in two levels;
what it does not carry (alltoall, send/recv, gather, one rank per host,
RING_TORCH_BACKEND=0) runs on its Gloo group and still works.

One pair of ranks runs every one-host check, four ranks every two-host one (ranks cost
seconds to start)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from ringcore.testing import run_workers

DTYPES = ("float32", "bfloat16", "int64")
OPS = ("SUM", "AVG", "MAX")
SIZES = (7, 300_000)  # one barrier's small path; several 1 MiB chunks


def _inputs(dtype, n: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(100 * rank + n)
    return torch.randint(-50, 50, (n,), generator=g).to(getattr(torch, dtype))


def _reference(gloo, t, op: str):
    """Gloo's answer; Average as Gloo's sum divided as ringcore divides (Gloo has no AVG)."""
    import torch
    import torch.distributed as dist

    x = t.clone()
    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "MAX" else dist.ReduceOp.SUM, group=gloo)
    if op == "AVG":
        n = dist.get_world_size()
        x = x / n if x.is_floating_point() else torch.div(x, n, rounding_mode="trunc")
    return x


def _collectives(pg, gloo) -> dict:
    """Each collective over "ring" against Gloo's: which disagreed, and how many
    ops took the shared-memory path."""
    import torch
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    bad, before = [], pg.stats["shm"]
    for dtype in DTYPES:
        for n in SIZES:
            t = _inputs(dtype, n, rank)
            for op in OPS:
                x = t.clone()
                dist.all_reduce(x, op=getattr(dist.ReduceOp, op))
                if not torch.equal(x, _reference(gloo, t, op)):
                    bad.append(f"all_reduce {dtype} {n} {op}")
            out, ref = torch.empty(size * n, dtype=t.dtype), torch.empty(size * n, dtype=t.dtype)
            dist.all_gather_single(out, t)
            dist.all_gather_single(ref, t, group=gloo)
            if not torch.equal(out, ref):
                bad.append(f"all_gather_single {dtype} {n}")
            outs = [torch.empty_like(t) for _ in range(size)]
            refs = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(outs, t)
            dist.all_gather(refs, t, group=gloo)
            if not all(torch.equal(a, b) for a, b in zip(outs, refs)):
                bad.append(f"all_gather {dtype} {n}")
            whole = t.repeat(size)
            for op in ("SUM", "MAX"):
                mine = torch.empty_like(t)
                dist.reduce_scatter_single(mine, whole, op=getattr(dist.ReduceOp, op))
                if not torch.equal(mine, _reference(gloo, t, op)):
                    bad.append(f"reduce_scatter_single {dtype} {n} {op}")
            mine = torch.empty_like(t)
            dist.reduce_scatter(mine, [t.clone() for _ in range(size)])
            if not torch.equal(mine, _reference(gloo, t, "SUM")):
                bad.append(f"reduce_scatter {dtype} {n}")
            x = t.clone()
            dist.broadcast(x, src=1)
            y = t.clone()
            dist.broadcast(y, src=1, group=gloo)
            if not torch.equal(x, y):
                bad.append(f"broadcast {dtype} {n}")
    # coalesced allreduce: two dtypes in one call, each fused in the segment's slot
    ts = [_inputs("float32", 5, rank), _inputs("int64", 3, rank), _inputs("float32", 70_000, rank)]
    xs = [t.clone() for t in ts]
    opts = dist.AllreduceCoalescedOptions()
    opts.reduceOp = dist.ReduceOp.SUM
    pg.allreduce_coalesced(xs, opts).wait()
    if not all(torch.equal(x, _reference(gloo, t, "SUM")) for x, t in zip(xs, ts)):
        bad.append("allreduce_coalesced")
    # a non-contiguous tensor is reduced in place
    m = _inputs("float32", 12, rank).view(3, 4).t()
    ref = _reference(gloo, m.contiguous(), "SUM")
    dist.all_reduce(m)
    if not torch.equal(m, ref):
        bad.append("all_reduce non-contiguous")
    # an async op's work and future, as DDP's comm hook uses them
    x = torch.ones(4) * (rank + 1)
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future().wait()
    total = float(size * (size + 1) // 2)
    if not (work.is_completed() and fut[0] is not None and fut[0].tolist() == [total] * 4):
        bad.append(f"async future {fut}")
    dist.barrier()
    return {"bad": bad, "shm_ops": pg.stats["shm"] - before, "gloo_ops": pg.stats["gloo"]}


def _fallbacks(pg) -> dict:
    """What "ring" hands to Gloo: alltoall, send/recv, gather, reduce."""
    import torch
    import torch.distributed as dist

    rank, before = dist.get_rank(), pg.stats["shm"]
    out = {}
    x = torch.arange(4.0) + 10 * rank
    y = torch.empty(4)
    dist.all_to_all_single(y, x)
    out["alltoall"] = y.tolist()
    peer = 1 - rank
    got = torch.empty(2)
    if rank == 0:
        dist.send(torch.tensor([1.0, 2.0]), dst=peer)
        dist.recv(got, src=peer)
    else:
        dist.recv(got, src=peer)
        dist.send(torch.tensor([3.0, 4.0]), dst=peer)
    out["sendrecv"] = got.tolist()
    gathered = [torch.empty(1) for _ in range(2)] if rank == 0 else None
    dist.gather(torch.tensor([float(rank + 5)]), gathered, dst=0)
    out["gather"] = [float(g) for g in gathered] if gathered else None
    r = torch.tensor([float(rank + 1)])
    dist.reduce(r, dst=0)
    out["reduce"] = float(r) if rank == 0 else None
    out["shm_ops"] = pg.stats["shm"] - before
    return out


def _mlp():
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )  # fmt: skip


def _ddp_weights(group) -> dict:
    """An MLP after 4 DDP steps over ``group`` (every rank starts alike, its own data)."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = DDP(_mlp(), process_group=group, bucket_cap_mb=0.01)  # several buckets
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(4):
        x = torch.randn(32, 16, generator=data)
        loss = (model(x) - x.sum(1, keepdim=True)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.module.state_dict().items()}


def _transformer():
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(50, 32)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
                for _ in range(2)
            )
            self.head = torch.nn.Linear(32, 50)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Tiny()


def _fsdp_losses(group) -> list[float]:
    """A tiny transformer, each block and the root sharded by FSDP2 over ``group``: the
    loss of each of 4 steps."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _transformer()
    mesh = DeviceMesh.from_group(group, "cpu")
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.Generator().manual_seed(dist.get_rank())
    losses = []
    for _ in range(4):
        tokens = torch.randint(0, 50, (4, 8), generator=data)
        logits = model(tokens)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.roll(1, 1).flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def _dtensor_sums(pg) -> list[float]:
    """DTensor's functional collectives (``full_tensor``: a coalesced all-gather from C++),
    many times over: through torch's trampoline's fall-through they once hung a rank."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = DeviceMesh.from_group(pg, "cpu")
    torch.manual_seed(0)
    shards = [distribute_tensor(torch.randn(64, 32), mesh, [Shard(0)]) for _ in range(10)]
    return [sum(float(d.full_tensor().sum()) for d in shards) for _ in range(20)]


def _one_host() -> dict:
    import torch
    import torch.distributed as dist

    import ringcore.dist_backend  # noqa: F401  (registers "ring")

    dist.init_process_group("cpu:ring,cuda:nccl")
    pg = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    out = {"type": type(pg).__name__, "reason": pg.reason, "name": pg.name()}
    out["collectives"] = _collectives(pg, gloo)
    out["fallbacks"] = _fallbacks(pg)
    before = pg.stats["shm"]
    ring, ref = _ddp_weights(None), _ddp_weights(gloo)
    out["ddp_shm_ops"] = pg.stats["shm"] - before
    out["ddp_equal"] = sorted(k for k in ring if torch.equal(ring[k], ref[k]))
    out["ddp_keys"] = sorted(ring)
    before = pg.stats["shm"]
    out["fsdp_ring"] = _fsdp_losses(pg)
    out["fsdp_shm_ops"] = pg.stats["shm"] - before
    out["fsdp_gloo"] = _fsdp_losses(gloo)
    before = pg.stats["shm"]
    out["dtensor"], out["dtensor_gloo"] = _dtensor_sums(pg), _dtensor_sums(gloo)
    out["dtensor_shm_ops"] = pg.stats["shm"] - before
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def one_host():
    return run_workers(_one_host, np=2, timeout=120)


def test_the_ring_group_is_ours_and_says_why(one_host):
    for r in one_host:
        assert (r["type"], r["reason"], r["name"]) == (
            "RingProcessGroup",
            "every rank on one host",
            "ring",
        )


def test_every_collective_equals_gloos_and_goes_through_shared_memory(one_host):
    for r in one_host:
        c = r["collectives"]
        assert c["bad"] == []
        # 3 dtypes x 2 sizes x (3 allreduce, 2 allgather, 3 reduce-scatter, broadcast),
        # coalesced, non-contiguous, async, barrier
        assert c["shm_ops"] == len(DTYPES) * len(SIZES) * 9 + 4


def test_what_ring_does_not_carry_runs_on_its_gloo_group(one_host):
    rank0, rank1 = (r["fallbacks"] for r in one_host)
    assert rank0["alltoall"] == [0.0, 1.0, 10.0, 11.0]
    assert rank1["alltoall"] == [2.0, 3.0, 12.0, 13.0]
    assert (rank0["sendrecv"], rank1["sendrecv"]) == ([3.0, 4.0], [1.0, 2.0])
    assert (rank0["gather"], rank0["reduce"]) == ([5.0, 6.0], 3.0)
    assert rank0["shm_ops"] == rank1["shm_ops"] == 0


def test_ddp_over_ring_ends_with_gloos_weights(one_host):
    for r in one_host:
        assert r["ddp_shm_ops"] > 4  # the start's broadcast, each step's buckets
        assert r["ddp_equal"] == r["ddp_keys"]


def test_fsdp2_over_ring_trains_with_gloos_losses(one_host):
    for r in one_host:
        assert r["fsdp_shm_ops"] > 4 * 3 * 2  # 3 units, all-gathers and reduce-scatters
        assert r["fsdp_ring"] == pytest.approx(r["fsdp_gloo"], rel=1e-6, abs=1e-7)
        assert r["fsdp_ring"][-1] < r["fsdp_ring"][0]  # it trains


def test_dtensor_full_tensor_over_ring_equals_gloos_and_never_hangs(one_host):
    for r in one_host:
        assert r["dtensor"] == r["dtensor_gloo"]
        assert r["dtensor_shm_ops"] == 200  # each all-gather through shared memory


def _gloo_only() -> dict:
    import torch
    import torch.distributed as dist

    import ringcore.dist_backend  # noqa: F401

    dist.init_process_group("ring")
    pg = dist.group.WORLD
    x = torch.arange(3.0) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    weights = _ddp_weights(None)
    dtensor = _dtensor_sums(pg)
    out = {"reason": pg.reason, "shm": pg.shm, "sum": x.tolist(), "stats": dict(pg.stats)}
    out["dtensor_same"] = len(set(dtensor)) == 1
    out["weights"] = float(sum(v.double().sum() for v in weights.values()))
    dist.destroy_process_group()
    return out


def _two_hosts() -> dict:
    """Two hosts of two ranks: every collective, DDP, FSDP2 and DTensor over "ring"
    against Gloo's."""
    import torch
    import torch.distributed as dist

    import ringcore.dist_backend  # noqa: F401

    dist.init_process_group("ring")
    pg = dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    out = {"reason": pg.reason, "hier": pg.hier is not None, "collectives": _collectives(pg, gloo)}
    before = pg.stats["shm"]
    ring, ref = _ddp_weights(None), _ddp_weights(gloo)
    out["ddp_shm_ops"] = pg.stats["shm"] - before
    out["ddp_diff"] = max(float((ring[k] - ref[k]).abs().max()) for k in ring)
    before = pg.stats["shm"]
    out["fsdp_ring"], out["fsdp_gloo"] = _fsdp_losses(pg), _fsdp_losses(gloo)
    out["fsdp_shm_ops"] = pg.stats["shm"] - before
    out["dtensor"], out["dtensor_gloo"] = _dtensor_sums(pg), _dtensor_sums(gloo)
    # a bool tensor (the segment's Sum is "or", Gloo's is not) takes the flat Gloo group
    before = dict(pg.stats)
    flags = torch.tensor([dist.get_rank() == 0, False])
    dist.all_reduce(flags)
    out["bool"] = (
        flags.tolist(),
        pg.stats["gloo"] - before["gloo"],
        pg.stats["shm"] - before["shm"],
    )
    # an op that fails on the group's thread fails the caller's wait (every rank's, here)
    real = pg.hier.allreduce_

    def broken(flat, op):
        raise RuntimeError("injected: the cross-host allreduce failed")

    pg.hier.allreduce_ = broken
    try:
        dist.all_reduce(torch.ones(3))
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    pg.hier.allreduce_ = real
    y = torch.ones(3)
    dist.all_reduce(y)
    out["after_error"] = y.tolist()
    dist.destroy_process_group()
    return out


@pytest.fixture(scope="module")
def two_hosts():
    return run_workers(
        _two_hosts, np=4, hosts=["host-a", "host-a", "host-b", "host-b"], timeout=180
    )


def test_two_hosts_of_two_ranks_run_every_collective_in_two_levels_as_gloo(two_hosts):
    for r in two_hosts:
        assert r["hier"] and r["reason"] == "hierarchical: 2 hosts x 2 ranks, the hosts over Gloo"
        c = r["collectives"]
        assert c["bad"] == []
        assert c["shm_ops"] == len(DTYPES) * len(SIZES) * 9 + 4
        assert r["bool"] == ([True, False], 1, 0)
        assert "injected: the cross-host allreduce failed" in r["error"]
        assert r["after_error"] == [4.0, 4.0, 4.0]  # the group goes on


def test_ddp_fsdp2_and_dtensor_across_hosts_over_ring_train_as_over_gloo(two_hosts):
    for r in two_hosts:
        assert r["ddp_shm_ops"] > 4 and r["ddp_diff"] < 1e-5  # sums in another order
        assert r["fsdp_shm_ops"] > 4 * 3 * 2
        assert r["fsdp_ring"] == pytest.approx(r["fsdp_gloo"], rel=1e-5)
        assert r["dtensor"] == r["dtensor_gloo"]


def test_one_rank_per_host_uses_gloo_for_every_op():
    results = run_workers(_gloo_only, np=2, hosts=["host-a", "host-b"], timeout=60)
    for r in results:
        assert r["reason"] == "one rank per host"
        assert (r["shm"], r["sum"], r["stats"]["shm"]) == (None, [0.0, 3.0, 6.0], 0)
    assert results[0]["weights"] == results[1]["weights"]
    assert all(r["dtensor_same"] for r in results)


def test_ring_torch_backend_0_makes_ring_gloo():
    results = run_workers(_gloo_only, np=2, env={"RING_TORCH_BACKEND": "0"}, timeout=60)
    for r in results:
        assert (r["reason"], r["shm"], r["sum"]) == ("RING_TORCH_BACKEND=0", None, [0.0, 3.0, 6.0])
        assert r["stats"]["shm"] == 0 and r["stats"]["gloo"] > 0
        assert r["dtensor_same"]


def test_importing_the_backend_loads_neither_pyspark_nor_ray():
    code = (
        "import sys, ringcore.dist_backend, torch.distributed as dist;"
        "assert 'RING' in dist.Backend._plugins;"
        "print(sorted(m for m in ('pyspark', 'ray') if m in sys.modules))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert (out.returncode, out.stdout.strip()) == (0, "[]"), out.stderr


def test_a_local_world_size_that_disagrees_keeps_the_world_on_gloo(monkeypatch):
    from ringcore.dist_backend import _local_size_disagrees

    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _local_size_disagrees(4) == "LOCAL_WORLD_SIZE=2 but the 4 ranks report one host"
    assert _local_size_disagrees(2) is None  # a subgroup: LOCAL_WORLD_SIZE is the world's
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert _local_size_disagrees(4) is None
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert _local_size_disagrees(4) is None  # not under torchrun: the host check decides
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # across hosts: the ranks of this host
    assert _local_size_disagrees(4, 2) == "LOCAL_WORLD_SIZE=4 but 2 of the 4 ranks report this host"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert _local_size_disagrees(4, 2) is None


def _vetoed() -> dict:
    import torch
    import torch.distributed as dist

    import ringcore.dist_backend  # noqa: F401

    dist.init_process_group("ring")
    pg = dist.group.WORLD
    x = torch.ones(3)
    dist.all_reduce(x)
    out = {"reason": pg.reason, "shm": pg.shm is None and pg.hier is None, "sum": x.tolist()}
    out["gloo_ops"] = pg.stats["gloo"]
    dist.destroy_process_group()
    return out


def test_a_local_world_size_that_disagrees_across_hosts_keeps_every_rank_on_gloo():
    hosts = ["host-a", "host-a", "host-b", "host-b"]
    results = run_workers(_vetoed, np=4, hosts=hosts, env={"LOCAL_WORLD_SIZE": "4"}, timeout=60)
    for r in results:
        assert r["reason"] == "LOCAL_WORLD_SIZE=4 but 2 of the 4 ranks report this host"
        assert (r["shm"], r["sum"], r["gloo_ops"]) == (True, [4.0, 4.0, 4.0], 1)


def test_the_host_plan_names_why_a_group_stays_on_gloo(monkeypatch):
    import datetime

    import torch.distributed as dist

    from ringcore.dist_backend import _host_plan
    from ringcore.shm.layer import host_key

    timeout = datetime.timedelta(seconds=5)

    def plan_of(*others: str) -> tuple[str, str]:
        """Rank 0's plan (rank 0 on this host) when ranks 1.. report ``others`` ("": this
        host)."""
        store = dist.HashStore()
        for r, h in enumerate(others, 1):
            store.set(f"ring-pg/host/{r}", h or host_key())
        p = _host_plan(store, 0, 1 + len(others), timeout)
        return p.mode, p.reason

    assert plan_of("") == ("flat", "every rank on one host")
    assert plan_of("b/other") == ("off", "one rank per host")
    assert plan_of("", "b/other", "b/other") == ("hierarchical", "2 hosts x 2 ranks")
    assert plan_of("", "b/other") == (
        "off",
        "several hosts, no hierarchy: hosts run different numbers of ranks ([2, 1])",
    )
    assert plan_of("b/other", "", "b/other") == (
        "off",
        "several hosts, no hierarchy: ranks are not numbered host by host",
    )
    monkeypatch.setenv("RING_HIERARCHICAL_ALLREDUCE", "0")
    assert plan_of("", "b/other", "b/other") == (
        "off",
        "several hosts, no hierarchy: RING_HIERARCHICAL_ALLREDUCE=0",
    )
    monkeypatch.delenv("RING_HIERARCHICAL_ALLREDUCE")
    assert _host_plan(dist.HashStore(), 0, 1, timeout).reason == "one rank"
    monkeypatch.setenv("RING_TORCH_BACKEND", "0")
    assert _host_plan(dist.HashStore(), 0, 2, timeout).reason == "RING_TORCH_BACKEND=0"
    monkeypatch.setenv("RING_TORCH_BACKEND", "1")
    monkeypatch.setenv("RING_SHM", "0")
    assert _host_plan(dist.HashStore(), 0, 2, timeout).reason == "RING_SHM=0"


def test_the_group_thread_runs_ops_in_order_fails_only_the_op_that_raised_and_drains_on_close():
    import torch

    from ringcore.shm.torch_hier import OpThread

    ran: list[int] = []
    thread = OpThread("test-ring-pg")

    def op(i: int):
        def run() -> None:
            if i == 2:
                raise RuntimeError("the cross-host allreduce timed out")
            ran.append(i)

        return run

    works = [thread.submit(op(i), [torch.tensor([float(i)])]) for i in range(5)]
    with pytest.raises(RuntimeError, match="the cross-host allreduce timed out"):
        works[2].wait()
    for i in (0, 1, 3, 4):
        works[i].wait()
        assert works[i].get_future().value()[0].item() == float(i)
    assert ran == [0, 1, 3, 4]
    late = thread.submit(op(5), [])
    thread.close()  # runs what was submitted before it returns
    assert ran == [0, 1, 3, 4, 5] and late.is_completed()
