"""torch.distributed programs run unchanged on ray_runner's launchers (torchrun's contract).

The programs are tests/_torch_programs.py's (DDP on env://, FSDP2, Lightning's
DDPStrategy, the Hugging Face Trainer), as a function and as a script
(tests/_torch_programs_main.py); each rank reports its world size, its rank and a digest
of the trained parameters, the same on every rank of a run that trained in step. On the
suite's shared local Ray instance (2 CPUs).
"""

from __future__ import annotations

import json
import os

import pytest
from _servers import local_ray

from ringcore import WorkerError
from ringcore.launch import ShippedScript

ray = pytest.importorskip("ray")

import _torch_programs  # noqa: E402

from ray_runner import (  # noqa: E402
    ElasticRayExecutor,
    RayExecutor,
    RingTrainer,
    RunConfig,
    ScalingConfig,
)

SHARED_RAY = True  # on the suite's shared local Ray instance (tests/_servers.py local_ray)

MAIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_torch_programs_main.py")
PROGRAMS = list(_torch_programs.PROGRAMS)  # in the order run_all runs them


@pytest.fixture(scope="module")
def ray_cluster():
    """The shared local Ray instance; the programs' module travels to the actors by value."""
    with local_ray(__name__):
        ray.cloudpickle.register_pickle_by_value(_torch_programs)
        try:
            yield
        finally:
            ray.cloudpickle.unregister_pickle_by_value(_torch_programs)


def _assert_in_step(per_rank: list[dict], names: list[str]) -> None:
    """Every rank ran every program in a world of 2, in step (one digest per program)."""
    assert len(per_rank) == 2
    for name in names:
        runs = [results[name] for results in per_rank]
        assert [r["world_size"] for r in runs] == [2, 2], (name, runs)
        assert sorted(r["rank"] for r in runs) == [0, 1], (name, runs)
        assert len({r["digest"] for r in runs}) == 1, (name, runs)


def _written(out_dir) -> list[dict]:
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(2)]


def _run_all_into(config: dict) -> None:
    """A RingTrainer loop: the programs, each rank's results written to ``config["out"]``."""
    results = _torch_programs.run_all(config.get("names"))
    with open(os.path.join(config["out"], f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)


def _ddp_in_generation() -> dict:
    """An elastic worker's torch.distributed program: the group of its generation."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    seen = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "RING_RANK", "MASTER_PORT")}
    dist.destroy_process_group()
    return {**seen, "sum": float(t)}


# ------------------------------------------------------------------------- bad input


def test_a_missing_script_or_non_string_arguments_are_refused_before_any_actor_runs(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    executor = RayExecutor(num_workers=2)  # never started: the check comes first
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        executor.run(str(tmp_path / "missing.py"))
    with pytest.raises(TypeError, match=r"argument 1 .* 3 \(int\)"):
        executor.run(str(script), args=["--epochs", 3])
    with pytest.raises(TypeError, match="command-line arguments only"):
        executor.run(str(script), kwargs={"lr": 0.1})
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        RingTrainer(str(tmp_path / "missing.py"))
    with pytest.raises(TypeError, match=r"argument 0 .* 0\.1 \(float\)"):
        RingTrainer(script, script_args=[0.1])
    with pytest.raises(ValueError, match="script_args"):
        RingTrainer(script, train_loop_config={"lr": 0.1})
    with pytest.raises(ValueError, match="elastic group"):
        RingTrainer(script, scaling_config=ScalingConfig(num_workers=(1, 2)))
    with pytest.raises(NotImplementedError, match="not scripts"):
        ElasticRayExecutor(min_workers=1).run_fn(str(script), (), {}, None)


# ------------------------------------------------------------------------ RayExecutor


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_torch_programs_run_unchanged_on_ray_executor_as_a_function_then_as_a_script(
    ray_cluster, tmp_path
):
    """The same two actors run the programs as a function, then as a script (Lightning
    and the Trainer leave a group behind: the actors end it between runs), then a
    script that fails on rank 1 and one that runs from a copy of the driver's bytes."""
    failing = tmp_path / "fails.py"
    failing.write_text(
        "import os, sys\nprint('rank', os.environ['RANK'])\nsys.exit(int(os.environ['RANK']) * 3)\n"
    )
    elsewhere = ShippedScript(
        "/nowhere/on/this/node/prog.py", ("x",), b"import sys\nprint(sys.argv[1:])\n"
    )
    with RayExecutor(num_workers=2, placement_group_timeout_s=60) as executor:
        _assert_in_step(executor.run(_torch_programs.run_all), PROGRAMS)
        # the script's own path (shipped, run as python would): one program
        assert executor.run(MAIN, args=[str(tmp_path / "out"), "ddp"]) == [None, None]
        _assert_in_step(_written(tmp_path / "out"), ["ddp"])
        with pytest.raises(WorkerError) as info:
            executor.run(str(failing))
        assert (info.value.rank, info.value.exit_code) == (1, 3)
        assert executor.run(elsewhere) == [None, None]


# ------------------------------------------------------------------------ RingTrainer


@pytest.mark.ray
@pytest.mark.timeout(300)
def test_torch_programs_run_unchanged_as_a_ring_trainer_loop_and_as_its_script(
    ray_cluster, tmp_path
):
    loop_out, script_out = tmp_path / "loop", tmp_path / "script"
    loop_out.mkdir()
    RingTrainer(
        _run_all_into,
        train_loop_config={"out": str(loop_out)},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="loop", storage_path=str(tmp_path), verbose=0),
    ).fit()
    _assert_in_step(_written(loop_out), PROGRAMS)
    result = RingTrainer(
        MAIN,
        script_args=[str(script_out), "ddp"],
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="script", storage_path=str(tmp_path), verbose=0),
    ).fit()
    assert result.error is None and result.metrics is None
    _assert_in_step(_written(script_out), ["ddp"])


# ------------------------------------------------------------------------ elastic


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_an_elastic_workers_torch_program_forms_the_group_of_its_generation(ray_cluster):
    executor = ElasticRayExecutor(min_workers=2, max_workers=2)
    executor.start()
    try:
        seen = executor.run(_ddp_in_generation)
    finally:
        executor.shutdown()
    assert [s["RANK"] for s in seen] == [s["RING_RANK"] for s in seen] == ["0", "1"]
    assert {s["WORLD_SIZE"] for s in seen} == {"2"}
    assert len({s["MASTER_PORT"] for s in seen}) == 1
    assert [s["sum"] for s in seen] == [3.0, 3.0]
