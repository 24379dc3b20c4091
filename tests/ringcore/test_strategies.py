"""ringcore.torch.strategies: ring, ddp and fsdp train the same model to the same
parameters; a sharded checkpoint written by 2 ranks loads on 1 (resharded), optimizer
state included; gradient accumulation and clipping work under each; bad input fails by
name before any rank starts."""

from __future__ import annotations

import pytest

from ringcore.testing import run_workers

STRATEGIES = ("ring", "ddp", "fsdp")


def _model():
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = torch.nn.Linear(8, 16)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(3))
            self.out = torch.nn.Linear(16, 1)

        def forward(self, x):
            x = self.inp(x)
            for layer in self.layers:
                x = torch.relu(layer(x))
            return self.out(x)

    net = Net()
    opt = torch.optim.AdamW(
        [
            {"params": [*net.inp.parameters(), *net.layers.parameters()], "lr": 0.01},
            {"params": net.out.parameters(), "lr": 0.005},
        ],
        weight_decay=0.1,
    )
    return net, opt


def _sums(state: dict) -> dict[str, float]:
    return {k: float(v.double().sum()) for k, v in state.items()}


def _train_each(folder: str) -> dict:
    """Every strategy in turn in one process: a different start on each rank (the
    strategy aligns them), 3 steps of 2 accumulated backward passes, clipped; then a
    sharded checkpoint and the full state."""
    import contextlib
    import os

    import torch

    import ringcore.torch as hvd
    from ringcore.torch.strategies import _group, get_strategy

    def through_shm() -> int:  # ops the strategies' "ring" group carried in shared memory
        return _group._ring[1].stats["shm"] if _group._ring else 0

    hvd.init()
    out = {}
    for name in STRATEGIES:
        torch.manual_seed(1 + hvd.rank())
        shm0 = through_shm()
        run = get_strategy(name).prepare(*_model(), backward_passes_per_step=2)
        data = torch.Generator().manual_seed(hvd.rank())
        for i in range(6):
            x = torch.randn(32, 8, generator=data)
            with run.no_sync() if i % 2 == 0 else contextlib.nullcontext():
                ((run.model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
            if i % 2:
                run.clip_grad_norm_(1.0)
                run.step()
        run.save_sharded(f"{folder}/{name}")
        out[name] = {
            "full": _sums(run.full_state_dict()),
            "lrs": [g["lr"] for g in run.optimizer.param_groups],
            "sharded": run.sharded,
            "shm_ops": through_shm() - shm0,
        }
    os.environ["RING_TORCH_BACKEND"] = "0"  # the off switch: the job's default group
    out["off"] = _group.strategy_group(torch.device("cpu"))
    return out


def _reload_each(folder: str) -> dict:
    import torch

    import ringcore.torch as hvd
    from ringcore.torch.strategies import get_strategy

    hvd.init()
    out = {}
    for name in STRATEGIES:
        torch.manual_seed(99)
        run = get_strategy(name).prepare(*_model())
        run.load_sharded(f"{folder}/{name}")
        steps = {int(s["step"]) for s in run.optimizer.state.values()}
        out[name] = {"full": _sums(run.full_state_dict()), "steps": sorted(steps)}
    return out


@pytest.mark.timeout(240)
def test_each_strategy_trains_alike_and_its_checkpoint_reloads_on_fewer_ranks(tmp_path):
    two = run_workers(_train_each, np=2, args=(str(tmp_path),), timeout=180)
    (one,) = run_workers(_reload_each, np=1, args=(str(tmp_path),), timeout=120)
    assert two[0]["off"] is None and two[1]["off"] is None
    ring = two[0]["ring"]["full"]
    assert set(ring) == {f"{m}.{p}" for m in ("inp", "out") for p in ("weight", "bias")} | {
        f"layers.{i}.{p}" for i in range(3) for p in ("weight", "bias")
    }
    for name in STRATEGIES:
        rank0, rank1 = two[0][name], two[1][name]
        assert rank0["full"] == pytest.approx(ring, rel=1e-5), name  # the same training
        assert rank0["lrs"] == [0.01, 0.005]  # the user's groups, rebuilt under fsdp
        # the full state on rank 0; under fsdp only there (gathered once)
        assert rank1["full"] == ({} if name == "fsdp" else rank0["full"]), name
        assert rank0["sharded"] == (name == "fsdp")
        # ddp and fsdp on the CPU run on the backend "ring": through shared memory
        assert (rank0["shm_ops"] > 0) == (name != "ring"), (name, rank0["shm_ops"])
        # 2 ranks' checkpoint on 1 rank: the same parameters, Adam's state at step 3
        assert one[name]["full"] == pytest.approx(rank0["full"], rel=1e-6), name
        assert one[name]["steps"] == [3], name


def _fsdp_job(folder: str) -> dict:
    """One fsdp job: a step, a sharded checkpoint; the mesh coordinate of each entry of
    the model's state_dict (tensors torch's DTensor dispatch made)."""
    import torch

    import ringcore.torch as hvd
    from ringcore.torch.strategies import get_strategy

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 2))
    run = get_strategy("fsdp").prepare(model, torch.optim.Adam(model.parameters()))
    run.model(torch.randn(3, 4)).sum().backward()
    run.step()
    coords = {k: v.device_mesh.get_coordinate() for k, v in model.state_dict().items()}
    run.save_sharded(folder)
    rank = hvd.rank()
    hvd.shutdown()
    return {"rank": rank, "coords": coords}


def _next_job_as_the_other_rank(folder: str) -> list[dict]:
    """A Spark Python worker runs job after job, not always as the same rank: here the
    second job swaps the ranks of the two processes (its launcher's variables)."""
    import os

    from ringcore import _config as cfg
    from ringcore.launch import torchrun_env
    from ringcore.rendezvous.environment import worker_env
    from ringcore.rendezvous.topology import topology_from_hosts

    first = _fsdp_job(f"{folder}/first")
    topology = topology_from_hosts(["127.0.0.1"] * 2, 1 - first["rank"])
    addr, port = os.environ[cfg.STORE_ADDR_ENV_VAR], int(os.environ[cfg.STORE_PORT_ENV_VAR])
    os.environ.update(
        worker_env(topology, addr, port, external_store=True,
                   secret=os.environ.get(cfg.SECRET_KEY_ENV_VAR))
    )  # fmt: skip
    os.environ.update(torchrun_env(topology, addr, int(os.environ["MASTER_PORT"]), "second"))
    return [first, _fsdp_job(f"{folder}/second")]


@pytest.mark.timeout(120)
def test_fsdp_in_a_process_that_was_the_other_rank_of_an_earlier_job(tmp_path):
    """torch caches DTensor sharding by mesh, and two meshes over the same ranks compare
    equal across process groups: without the cache forgotten when a group forms, the
    second job's tensors carried the first job's mesh (this process's earlier rank), and
    its checkpoint lost a shard ("invalid fill", seen in CI)."""
    results = run_workers(_next_job_as_the_other_rank, np=2, args=(str(tmp_path),), timeout=90)
    for first, second in results:
        assert second["rank"] == 1 - first["rank"]
        for job in (first, second):
            assert set(job["coords"].values()) == {(job["rank"],)}, job


def test_bad_strategy_input_is_refused_by_name():
    import torch

    from ringcore.torch.strategies import FsdpConfig, get_strategy, strategy_names

    assert strategy_names()[:3] == ["ring", "ddp", "fsdp"]
    with pytest.raises(ValueError, match=r"strategy='zero3' is not a known strategy.*'fsdp'"):
        get_strategy("zero3")
    with pytest.raises(ValueError, match="ReLU has no trainable ones; use strategy='ring'"):
        get_strategy("fsdp").check(torch.nn.ReLU())
    with pytest.raises(ValueError, match="fsdp_config is for strategy='fsdp'"):
        get_strategy("ddp").check(torch.nn.Linear(2, 2), {"cpu_offload": True})
    for name in ("ring", "ddp"):  # prepare() checks too, before it touches any group
        with pytest.raises(ValueError, match=f"strategy={name!r} takes none"):
            get_strategy(name).prepare(torch.nn.Linear(2, 2), config={"cpu_offload": True})
    with pytest.raises(ValueError, match=r"unknown key.*'offload'.*cpu_offload"):
        FsdpConfig.of({"offload": True})
    with pytest.raises(ValueError, match="param_dtype='int8' is not a floating dtype"):
        FsdpConfig(param_dtype="int8")
    with pytest.raises(ValueError, match="names 'BertLayer', which Linear does not contain"):
        get_strategy("fsdp").check(torch.nn.Linear(2, 2), {"shard_modules": ["BertLayer"]})
    assert FsdpConfig.of({"param_dtype": "bf16"}).param_dtype == "bfloat16"
