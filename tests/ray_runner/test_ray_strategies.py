"""ray_runner.prepare_model(parallel_strategy=...) in a RingTrainer loop: ring, ddp and fsdp
train a model to the same parameters, full_state_dict gives the unwrapped module's whole
state under each, and save_sharded's per-rank files, reported by every rank, make one
checkpoint folder; bad arguments fail by name before the ring forms.

On the suite's shared local Ray instance (2 CPUs, 2 workers), one fit.
"""

from __future__ import annotations

import os

import pytest
from _servers import local_ray

ray = pytest.importorskip("ray")
torch = pytest.importorskip("torch")

import ray_runner  # noqa: E402
from ray_runner import Checkpoint, RingTrainer, RunConfig, ScalingConfig  # noqa: E402

SHARED_RAY = True  # on the suite's shared local Ray instance (tests/_servers.py local_ray)
STRATEGIES = ("ring", "ddp", "fsdp")
KEYS = {f"{m}.{p}" for m in ("inp", "layers.0", "layers.1", "out") for p in ("weight", "bias")}


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(__name__):  # the loop below travels by value
        yield


def _net():
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(4, 8)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(2))
            self.out = torch.nn.Linear(8, 1)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.out(x)

    return Net()


def _train(strategy: str, rank: int, steps: int = 3):
    """A different start on each rank (prepare_model aligns them), different data on
    each rank, SGD steps with momentum; the optimizer built after prepare_model."""
    torch.manual_seed(1 + rank + 10 * (steps == 0))
    model = ray_runner.prepare_model(_net(), parallel_strategy=strategy)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    data = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x = torch.randn(16, 4, generator=data)
        loss = ((model(x) - x.sum(1, keepdim=True)) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, optimizer


def _flat(model) -> dict:
    return {k: v.flatten().tolist() for k, v in ray_runner.full_state_dict(model).items()}


def _loop(config):
    import copy
    import tempfile

    rank = ray_runner.get_context().get_world_rank()
    states = {}
    for strategy in STRATEGIES:
        model, optimizer = _train(strategy, rank)
        states[strategy] = _flat(model)
        if strategy == "ddp":  # a copy of the module is a plain module, not a prepared one
            try:
                ray_runner.full_state_dict(copy.deepcopy(model.module))
                copied = "prepared"
            except ValueError as exc:
                copied = str(exc)
    ray_runner.save_sharded(model, config["shared"], optimizer=optimizer)  # one folder
    fresh, fresh_optimizer = _train("fsdp", rank, steps=0)  # another start, no state
    ray_runner.load_sharded(fresh, config["shared"], optimizer=fresh_optimizer)
    metrics = {"states": states, "copied": copied, "reloaded": _flat(fresh)}
    metrics["momenta"] = len(fresh_optimizer.state)
    with tempfile.TemporaryDirectory() as folder:  # the fsdp model: each rank its shard
        ray_runner.save_sharded(model, folder, optimizer=optimizer)
        ray_runner.report(metrics, checkpoint=Checkpoint.from_directory(folder))


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_ring_ddp_and_fsdp_train_alike_and_fsdp_shards_make_one_checkpoint(ray_cluster, tmp_path):
    import torch.distributed.checkpoint as dcp

    result = RingTrainer(
        _loop,
        train_loop_config={"shared": str(tmp_path / "shared")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="strategies", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert "was not prepared" in result.metrics["copied"]
    states = result.metrics["states"]  # rank 0's: under fsdp the only rank that has it
    for strategy in STRATEGIES:
        assert set(states[strategy]) == KEYS, strategy  # the module's keys, no "module."
        for key in KEYS:
            assert states[strategy][key] == pytest.approx(states["ring"][key], rel=1e-5), (
                strategy,
                key,
            )
    # save_sharded into one folder, load_sharded into another start: the model and
    # the optimizer's momentum for each of its 8 parameters
    assert result.metrics["reloaded"] == states["fsdp"]
    assert result.metrics["momenta"] == len(KEYS)
    with result.checkpoint.as_directory() as path:  # each rank's folder, merged
        assert {".metadata", "__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(path))
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        assert "optim.state.layers.1.weight.momentum_buffer" in saved
        plain = _net()
        state = {"model": plain.state_dict()}
        with pytest.warns(UserWarning, match="single process"):  # no process group here
            dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    for key, value in plain.state_dict().items():  # both ranks' shards, whole again
        assert value.flatten().tolist() == pytest.approx(states["fsdp"][key], rel=1e-6), key


def test_prepare_model_refuses_bad_arguments_by_name_before_the_ring_forms():
    net = torch.nn.Linear(2, 2)
    with pytest.raises(
        ValueError,
        match=r"parallel_strategy='zero3'\) is not a strategy; use one of 'ring', 'ddp', "
        r"'fsdp'.* or None",
    ):
        ray_runner.prepare_model(net, parallel_strategy="zero3")
    with pytest.raises(
        ValueError, match=r"parallel_strategy='ddp'\) takes no parallel_strategy_kwargs"
    ):
        ray_runner.prepare_model(net, parallel_strategy="ddp", parallel_strategy_kwargs={"a": 1})
    with pytest.raises(ValueError, match=r"unknown key.*'auto_wrap_policy'.*cpu_offload"):
        ray_runner.prepare_model(
            net, parallel_strategy="fsdp", parallel_strategy_kwargs={"auto_wrap_policy": 1}
        )
    with pytest.raises(TypeError, match=r"takes a torch\.nn\.Module, got dict"):
        ray_runner.prepare_model({}, parallel_strategy="fsdp")
    with pytest.raises(ValueError, match=r"Linear was not prepared.*prepare_model"):
        ray_runner.full_state_dict(net)
    import ringcore.torch as hvd

    assert not hvd.is_initialized()  # refused before prepare_model formed the ring
