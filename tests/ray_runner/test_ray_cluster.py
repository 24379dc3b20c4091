"""ray_runner on a real two-node ``ray.cluster_utils.Cluster`` (1 CPU per node, 127.0.0.1):
local and cross ranks by Ray node, STRICT_SPREAD placement, an existing placement
group, and elastic RingTrainer runs that lose a node mid-training and grow back.

Both nodes share the IP 127.0.0.1, so ranks are told apart by Ray node id: that is
what the rank assignment must do anyway (two raylets on one machine, or nodes behind
one address).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time

import pytest
from _reliability import record

ray = pytest.importorskip("ray")

from ray.cluster_utils import Cluster  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402

import ray_runner  # noqa: E402
from ray_runner import (  # noqa: E402
    PlacementGroupTimeoutError,
    RayExecutor,
    RingTrainer,
    RunConfig,
    ScalingConfig,
)

pytestmark = pytest.mark.ray

_NODE = {"num_cpus": 1, "node_ip_address": "127.0.0.1"}


@contextlib.contextmanager
def loopback_only():
    """Let ``ray.init(address="127.0.0.1:...")`` reach a cluster bound to 127.0.0.1.

    Ray rewrites a loopback address to the machine's own IP before connecting, unless
    its ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` setting is in force; that setting is read
    at import, so the test sets the constant it feeds for the module's duration.
    """
    import ray._private.ray_constants as ray_constants

    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


@pytest.fixture(scope="module")
def two_nodes():
    """A head node and one worker node, 1 CPU each; the driver joined to it."""
    if ray.is_initialized():
        ray.shutdown()
    with loopback_only():
        cluster = Cluster(
            initialize_head=True, head_node_args={**_NODE, "include_dashboard": False}
        )
        try:
            cluster.add_node(**_NODE)
            cluster.wait_for_nodes()
            ray.init(address=cluster.address)
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
            try:
                yield cluster
            finally:
                ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        finally:
            ray.shutdown()
            cluster.shutdown()


def _ranks():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return {
        "rank": hvd.rank(),
        "local": (hvd.local_rank(), hvd.local_size()),
        "cross": (hvd.cross_rank(), hvd.cross_size()),
        "node": ray.get_runtime_context().get_node_id(),
        "sum": total,
    }


@pytest.mark.timeout(120)
def test_two_workers_on_two_nodes_get_local_rank_0_and_cross_ranks_0_and_1(two_nodes):
    with RayExecutor(num_workers=2, placement_group_timeout_s=60) as ex:
        results = ex.run(_ranks)
        assert [r["rank"] for r in results] == [0, 1]
        assert [r["local"] for r in results] == [(0, 1), (0, 1)]
        assert [r["cross"] for r in results] == [(0, 2), (1, 2)]
        assert [r["node"] for r in results] == ex.node_ids
        assert len(set(ex.node_ids)) == 2 and ex.hosts == ["127.0.0.1"] * 2
        assert [r["sum"] for r in results] == [3.0, 3.0]


@pytest.mark.timeout(120)
def test_num_hosts_places_one_bundle_per_node_with_strict_spread(two_nodes):
    with RayExecutor(num_hosts=2, num_workers_per_host=1, placement_group_timeout_s=60) as ex:
        table = ray.util.placement_group_table(ex._pg)
        assert table["strategy"] == "STRICT_SPREAD"
        assert len(set(table["bundles_to_node_id"].values())) == 2
        assert sorted(ex.node_ids) == sorted(set(table["bundles_to_node_id"].values()))
        assert [r["cross"] for r in ex.run(_ranks)] == [(0, 2), (1, 2)]
    # three hosts cannot be strictly spread over two nodes
    ex = RayExecutor(num_hosts=3, cpus_per_worker=0.5, placement_group_timeout_s=1)
    with pytest.raises(PlacementGroupTimeoutError, match="strategy STRICT_SPREAD"):
        ex.start()


@pytest.mark.timeout(120)
def test_executor_uses_a_given_placement_group_and_leaves_it_in_place(two_nodes):
    pg = placement_group([{"CPU": 0.5}, {"CPU": 0.5}], strategy="STRICT_SPREAD")
    assert pg.wait(60)
    try:
        with RayExecutor(num_workers=2, cpus_per_worker=0.5, placement_group=pg) as ex:
            assert ex._pg is pg and len(set(ex.node_ids)) == 2
            assert [r["rank"] for r in ex.run(_ranks)] == [0, 1]
        assert ray.util.placement_group_table(pg)["state"] == "CREATED"
        # more workers than the given group holds: a clear error, not a hang
        ex = RayExecutor(
            num_workers=3, cpus_per_worker=0.5, placement_group=pg, placement_group_timeout_s=2
        )
        with pytest.raises(PlacementGroupTimeoutError, match="existing placement group"):
            ex.start()
        assert ex.workers == []
    finally:
        remove_placement_group(pg)


# ---------------------------------------------------------------------------- elastic

N, BATCH = 24, 4


def _marker(config, name):
    open(os.path.join(config["markers"], name), "w").close()


def _elastic_loop(config):
    import time

    import torch

    import ringcore.torch as hvd
    from ringcore.torch import elastic

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    # Gradients averaged by a blocking grouped allreduce: a failure leaves nothing pending.
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    sampler = elastic.ElasticSampler(N, shuffle=True, seed=1)
    state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, counts={}, sizes=[])
    data = torch.arange(N, dtype=torch.float32).view(-1, 1).repeat(1, 3)

    def regrown(sizes):
        return 1 in sizes and sizes[-1] == 2 and sizes.index(1) < len(sizes) - 1

    @elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        if hvd.rank() == 0:
            _marker(config, "sizes_" + "-".join(map(str, state.sizes)))
        while True:
            indices = list(state.sampler)
            for b in range(0, len(indices), BATCH):
                chunk = indices[b : b + BATCH]
                opt.zero_grad()
                model(data[chunk]).sum().backward()
                grads = [p.grad for p in model.parameters()]
                for grad, avg in zip(grads, hvd.grouped_allreduce(grads, name="grads")):
                    grad.copy_(avg)
                opt.step()
                count = int(hvd.allreduce(torch.tensor([len(chunk)]), op=hvd.Sum, name="n").item())
                state.counts[state.epoch] = state.counts.get(state.epoch, 0) + count
                state.sampler.record_indices(chunk)
                time.sleep(config["step_s"])
                state.commit()
            hvd.join()  # after a re-shard one rank may hold a batch more
            if hvd.rank() == 0:
                ray_runner.report(
                    {
                        "epoch": state.epoch,
                        "samples": state.counts[state.epoch],
                        "covered": len(state.sampler.processed),
                        "size": hvd.size(),
                        "sizes": "-".join(map(str, state.sizes)),
                    }
                )
                _marker(config, f"epoch_{state.epoch}")
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
            if state.epoch >= config["max_epochs"] or (
                state.epoch >= config["min_epochs"] and regrown(state.sizes)
            ):
                return

    train(state)


def _wait_for(path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.1)


@pytest.mark.reliability(
    fault="a Ray node removed mid-training (elastic RingTrainer)", category="fault"
)
@pytest.mark.timeout(240)
def test_elastic_fit_loses_a_node_goes_on_with_one_worker_and_grows_back(
    two_nodes, tmp_path, request
):
    markers = tmp_path / "markers"
    markers.mkdir()
    cluster = two_nodes
    trainer = RingTrainer(
        _elastic_loop,
        train_loop_config={
            "markers": str(markers),
            "step_s": 0.1,
            "min_epochs": 3,
            "max_epochs": 150,
        },
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="elastic", storage_path=str(tmp_path), verbose=0),
    )
    outcome: dict = {}

    def fit():
        try:
            outcome["result"] = trainer.fit()
        except BaseException as exc:  # re-raised below, in the test's thread
            outcome["error"] = exc

    # fit() in a thread; the cluster changes here (Ray starts nodes from the main thread only)
    thread = threading.Thread(target=fit, daemon=True)
    thread.start()
    events: list[str] = []
    try:
        _wait_for(str(markers / "epoch_1"), 120)
        (worker_node,) = list(cluster.worker_nodes)
        cluster.remove_node(worker_node)
        removed_at = time.monotonic()
        events.append("removed")
        _wait_for(str(markers / "sizes_2-1"), 120)
        recovered_s = time.monotonic() - removed_at
        cluster.add_node(**_NODE)
        events.append("added")
    finally:
        thread.join(180)
    assert not thread.is_alive(), "fit() did not return"
    if "error" in outcome:
        raise outcome["error"]
    result = outcome["result"]
    assert events == ["removed", "added"]
    history = result.metrics_history
    # every sample once per epoch, whichever ranks trained it
    assert all(m["samples"] == N and m["covered"] == N for m in history), history
    assert sorted({m["epoch"] for m in history}) == list(range(history[-1]["epoch"] + 1))
    assert {m["size"] for m in history} == {1, 2}
    assert result.metrics is not None
    assert (result.metrics["sizes"], result.metrics["size"]) == ("2-1-2", 2)
    alive = [a for a in ray._private.state.actors().values() if a["State"] == "ALIVE"]
    assert alive == []  # no worker, pending or not, outlives fit()
    record(request, recover_s=recovered_s, note="went on with 1 worker, grew back to 2")


def test_elastic_num_workers_must_be_an_ordered_pair_of_positive_integers():
    with pytest.raises(ValueError, match=r"num_workers=\(min, max\)"):
        ScalingConfig(num_workers=(2, 1))
    with pytest.raises(ValueError, match=r"num_workers=\(min, max\)"):
        ScalingConfig(num_workers=(0, 2))
    sc = ScalingConfig(num_workers=(1, 3))
    assert (sc.elastic, sc.min_workers, sc.max_workers) == (True, 1, 3)
