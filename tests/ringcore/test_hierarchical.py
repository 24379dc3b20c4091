"""Hierarchical allreduce across hosts made of network namespaces (``tests/_netns.py``).

Each rank runs allreduces of several sizes and operators through the engine and the
same reductions directly on the default Gloo group (the flat ring) in the same
process, and reports both. On 2 hosts x 2 ranks the engine must pick the
hierarchical plan and agree with the flat ring; on 2 + 1 ranks it must keep the flat
ring. The torch.distributed backend "ring" must do the same with its own collectives
(allreduce, all-gather, reduce-scatter, broadcast). Skipped where root or ``ip netns``
is missing.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from _netns import Cluster, kill_tree, unavailable

from ringcore import topology_from_hosts, worker_env

_WHY = unavailable()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
    pytest.mark.timeout(180),
]

_SCRIPT = """
import json
import torch, torch.distributed as dist
from ringcore.runtime import state as st
import ringcore.torch as hvd
from ringcore.engine.reduction import average_

hvd.init()
r, n = hvd.rank(), hvd.size()
backend = st.current.engine.backend
flat_ops = {"Sum": dist.ReduceOp.SUM, "Average": dist.ReduceOp.SUM, "Min": dist.ReduceOp.MIN,
            "Max": dist.ReduceOp.MAX, "Product": dist.ReduceOp.PRODUCT}
differ, checked = [], 0
for dtype in (torch.float32, torch.int64, torch.bfloat16):
    for numel in (1, 3, 1001, 300_001):
        x = ((torch.arange(numel) * (r + 1)) % 5 - 2).to(dtype)  # exact in every dtype
        for op, flat_op in flat_ops.items():
            ours = hvd.allreduce(x, op=getattr(hvd, op))
            flat = x.clone()
            dist.all_reduce(flat, op=flat_op)
            if op == "Average":
                average_(flat, n)
            checked += 1
            if not torch.equal(ours, flat):
                differ.append(f"{dtype}/{numel}/{op}")
# the torch.distributed backend "ring" on the same hosts, against the default (Gloo) group
import ringcore.dist_backend  # noqa: F401
ring = dist.new_group(backend="ring")
ring_differ = []
for dtype in (torch.float32, torch.int64):
    for numel in (3, 300_001):
        x = ((torch.arange(numel) * (r + 1)) % 5 - 2).to(dtype)
        a, b = x.clone(), x.clone()
        dist.all_reduce(a, group=ring)
        dist.all_reduce(b)
        a2, b2 = torch.empty(n * numel, dtype=dtype), torch.empty(n * numel, dtype=dtype)
        dist.all_gather_into_tensor(a2, x, group=ring)
        dist.all_gather_into_tensor(b2, x)
        a3, b3 = torch.empty(numel, dtype=dtype), torch.empty(numel, dtype=dtype)
        dist.reduce_scatter_tensor(a3, torch.cat([x * (i + 1) for i in range(n)]), group=ring)
        dist.reduce_scatter_tensor(b3, torch.cat([x * (i + 1) for i in range(n)]))
        a4, b4 = x.clone(), x.clone()
        dist.broadcast(a4, src=n - 1, group=ring)
        dist.broadcast(b4, src=n - 1)
        for what, u, v in (("allreduce", a, b), ("allgather", a2, b2),
                           ("reducescatter", a3, b3), ("broadcast", a4, b4)):
            if not torch.equal(u, v):
                ring_differ.append(f"{what}/{dtype}/{numel}")
print(json.dumps({
    "rank": r, "mode": getattr(backend, "mode", None), "stats": getattr(backend, "stats", None),
    "class": type(backend).__name__, "checked": checked, "differ": differ,
    "ring": ring.reason, "ring_shm": ring.stats["shm"], "ring_differ": ring_differ,
}), flush=True)
hvd.shutdown()
"""


@pytest.fixture(scope="module")
def cluster():
    made = Cluster(2).up()
    try:
        yield made
    finally:
        made.down()


def _env(topo, store_addr: str, port: int) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)
    env.update(worker_env(topo, store_addr, port))
    env.update({"PYTHONPATH": os.getcwd(), "RING_START_TIMEOUT": "40"})
    env.pop("RING_HOSTNAME", None)  # each host's own hostname tells the hosts apart
    return env


def _run(slots) -> list[dict]:
    """One subprocess per rank, rank r on ``slots[r]``; rank 0 hosts the store."""
    port = random.randint(20000, 40000)
    addrs = [h.addr for h in slots]
    procs = []
    try:
        for rank, host in enumerate(slots):
            env = _env(topology_from_hosts(addrs, rank), slots[0].addr, port)
            procs.append(
                subprocess.Popen(
                    host.wrap([sys.executable, "-c", _SCRIPT]),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
            )
        outputs = [p.communicate(timeout=150) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    failed = [(r, p.returncode, err[-3000:]) for r, (p, (_, err)) in enumerate(zip(procs, outputs))]
    assert all(rc == 0 for _, rc, _ in failed), failed
    return [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]


def test_two_hosts_of_two_ranks_reduce_hierarchically_and_agree_with_the_flat_ring(cluster):
    a, b = cluster.hosts
    results = _run([a, a, b, b])
    for res in results:
        assert res["mode"] == "hierarchical"
        assert res["checked"] == 60 and res["differ"] == []
        assert res["stats"]["hierarchical"] == 60 and res["stats"]["network"] == 0
        # the backend "ring" runs the same two levels for torch.distributed programs
        assert res["ring"] == "hierarchical: 2 hosts x 2 ranks, the hosts over Gloo"
        assert res["ring_shm"] == 16 and res["ring_differ"] == []


def test_two_ranks_on_one_host_and_one_on_another_keep_the_flat_ring(cluster):
    a, b = cluster.hosts
    results = _run([a, a, b])
    for res in results:
        assert res["class"] != "ShmBackend" and res["mode"] is None
        assert res["checked"] == 60 and res["differ"] == []
        assert res["ring"] == (
            "several hosts, no hierarchy: hosts run different numbers of ranks ([2, 1])"
        )
        assert res["ring_shm"] == 0 and res["ring_differ"] == []
