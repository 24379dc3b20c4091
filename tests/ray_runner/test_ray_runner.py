"""ray_runner on a real local Ray instance (2 CPUs): RayExecutor, RingTrainer, their configs.

One Ray instance serves the whole module; every test that places workers removes
them again (a check after each test fails it when a placement group is left behind).
Worker functions are plain module-level functions made of asserts, shipped to the
actors by value.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import pytest
from _reliability import record
from _servers import local_ray

import ringcore
from ringcore import WorkerError

ray = pytest.importorskip("ray")

import ray_runner  # noqa: E402
from ray_runner import (  # noqa: E402
    Checkpoint,
    CheckpointConfig,
    FailureConfig,
    PlacementGroupTimeoutError,
    RayExecutor,
    RingTrainer,
    RunConfig,
    ScalingConfig,
    TrainingFailedError,
)
from ray_runner._checkpoint import CheckpointStore  # noqa: E402

SHARED_RAY = True  # on the suite's shared local Ray instance (tests/_servers.py local_ray)

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ray_cluster():
    """The suite's shared local Ray instance, 2 CPUs (tests/_servers.py local_ray)."""
    with local_ray(__name__):  # the worker functions here travel by value
        yield


def _live_placement_groups() -> set[str]:
    if not ray.is_initialized():
        return set()
    table = ray.util.placement_group_table()
    return {pg_id for pg_id, info in table.items() if info["state"] != "REMOVED"}


@pytest.fixture(autouse=True)
def no_leftover_placement_groups():
    """Fail a test that leaves a placement group behind (and remove it, for the next test).

    Groups alive before the test (a class-scoped executor's) are not the test's to remove.
    """
    before = _live_placement_groups()
    yield
    left = sorted(_live_placement_groups() - before)
    from ray.util.placement_group import PlacementGroup, remove_placement_group

    for pg_id in left:
        remove_placement_group(PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    assert not left, f"the test left placement groups behind: {left}"


class _Tagger:
    """An executable: what execute(fn) hands to fn on every worker."""

    def __init__(self, tag: str):
        self.tag = tag


@pytest.fixture(scope="class")
def executor(ray_cluster):
    ex = RayExecutor(num_workers=2, placement_group_timeout_s=60)
    ex.start(executable_cls=_Tagger, executable_args=("tagged",))
    try:
        yield ex
    finally:
        ex.shutdown()


# --------------------------------------------------------------------- worker functions


def _where_am_i():
    return {
        "rank": int(os.environ["RING_RANK"]),
        "size": int(os.environ["RING_SIZE"]),
        "local_rank": int(os.environ["RING_LOCAL_RANK"]),
        "local_size": int(os.environ["RING_LOCAL_SIZE"]),
        "host": os.environ["RING_HOSTNAME"],
    }


def _allreduce_sum(base: float):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    mine = torch.tensor([base * (hvd.rank() + 1), 1.0])
    return hvd.rank(), hvd.allreduce(mine, op=hvd.Sum).tolist()


def _init_and_size():
    ringcore.init()
    return ringcore.size()


def _raise_on_rank_one():
    if int(os.environ["RING_RANK"]) == 1:
        raise ValueError("boom on rank 1")
    return "fine"


@contextlib.contextmanager
def _temp_checkpoint(files: dict[str, str]):
    """A checkpoint in a temporary directory, deleted once report() has copied it away."""
    with tempfile.TemporaryDirectory(prefix="ring_test_ckpt_") as tmp:
        for name, text in files.items():
            with open(os.path.join(tmp, name), "w") as fh:
                fh.write(text)
        yield Checkpoint.from_directory(tmp)


def _three_iterations_loop(config):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    ctx = ray_runner.get_context()
    assert (ctx.get_world_rank(), ctx.get_world_size()) == (hvd.rank(), 2)
    assert (ctx.get_local_rank(), ctx.get_local_world_size(), ctx.get_node_rank()) == (
        hvd.rank(),
        2,
        0,
    )
    assert ray_runner.get_checkpoint() is None
    for it in range(3):
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        loss = config["scale"] / (it + 1)
        with _temp_checkpoint({"it": str(it)}) as ckpt:
            ray_runner.report({"iteration": it, "loss": loss, "sum": total}, checkpoint=ckpt)


def _fails_once_loop(config):
    import ringcore.torch as hvd

    hvd.init()
    restored = ray_runner.get_checkpoint()
    start = 0
    if restored is not None:
        with restored.as_directory() as path, open(os.path.join(path, "it")) as fh:
            start = int(fh.read()) + 1
    for it in range(start, 3):
        hvd.barrier()
        metrics = {"iteration": it, "resumed_from": -1 if restored is None else start - 1}
        with _temp_checkpoint({"it": str(it)}) as ckpt:
            ray_runner.report(metrics, checkpoint=ckpt)
        if it == 1 and hvd.rank() == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            raise RuntimeError("first attempt dies on rank 1")


def _killed_once_loop(config):
    import signal

    import ringcore.torch as hvd

    hvd.init()
    restored = ray_runner.get_checkpoint()
    start = 0
    if restored is not None:
        with restored.as_directory() as path, open(os.path.join(path, "it")) as fh:
            start = int(fh.read()) + 1
    for it in range(start, 3):
        hvd.barrier()
        with _temp_checkpoint({"it": str(it)}) as ckpt:
            ray_runner.report({"iteration": it, "start": start}, checkpoint=ckpt)
        hvd.barrier()  # rank 0's report is in before rank 1 dies
        if it == 1 and hvd.rank() == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            os.kill(os.getpid(), signal.SIGKILL)  # the actor dies mid-epoch


MID_EPOCHS, MID_STEPS = 3, 4  # the mid-epoch kill: 3 epochs of 4 steps, a checkpoint per epoch


def _step_value(epoch: int, step: int) -> float:
    return float(epoch * 10 + step + 1)


def _expected_mid_epoch_total() -> float:
    """What an uninterrupted run of :func:`_killed_between_checkpoints_loop` ends with: every
    step adds rank 1's and rank 2's share, ``(1 + 2) * _step_value``, exactly once."""
    return sum(3 * _step_value(e, s) for e in range(MID_EPOCHS) for s in range(MID_STEPS))


def _killed_between_checkpoints_loop(config):
    import json
    import signal

    import torch

    import ringcore.torch as hvd

    hvd.init()
    restored = ray_runner.get_checkpoint()
    start, total = 0, 0.0
    if restored is not None:
        with restored.as_directory() as path, open(os.path.join(path, "state.json")) as fh:
            saved = json.load(fh)
        start, total = saved["epoch"] + 1, saved["total"]
    for epoch in range(start, MID_EPOCHS):
        for step in range(MID_STEPS):
            if (epoch, step) == (1, 2) and hvd.rank() == 1 and not os.path.exists(config["marker"]):
                # between the checkpoints of epochs 0 and 1, after two steps of epoch 1
                with open(config["marker"], "w") as fh:
                    json.dump({"epoch": epoch, "step": step, "total": total}, fh)
                os.kill(os.getpid(), signal.SIGKILL)
            share = torch.tensor([(hvd.rank() + 1) * _step_value(epoch, step)])
            total += hvd.allreduce(share, op=hvd.Sum, name="share").item()
            metrics = {"epoch": epoch, "step": step, "start": start, "total": total}
            if step == MID_STEPS - 1:
                state = {"state.json": json.dumps({"epoch": epoch, "total": total})}
                with _temp_checkpoint(state) as ckpt:
                    ray_runner.report(metrics, checkpoint=ckpt)
            else:
                ray_runner.report(metrics)
            hvd.barrier()  # rank 0's report is in before rank 1 dies


def _every_rank_fails_loop():
    import ringcore

    ringcore.init()
    raise ValueError(f"bad shard on rank {ringcore.rank()}")


def _count_rows_loop(config):
    import ringcore.torch as hvd

    hvd.init()
    shard = ray_runner.get_dataset_shard("train")
    for epoch in range(config["epochs"]):
        mine = [int(i) for batch in shard.iter_batches(batch_size=8) for i in batch["id"]]
        every = sorted(i for part in hvd.allgather_object(mine) for i in part)
        ray_runner.report(
            {"epoch": epoch, "mine": len(mine), "every_row_once": every == list(range(config["n"]))}
        )


def _tuned_loop(config):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    for step in range(2):
        total = hvd.allreduce(torch.tensor([config["lr"]]), op=hvd.Sum).item()
        ray_runner.report({"step": step, "loss": total * (step + 1), "size": hvd.size()})


def _always_fails_loop():
    import ringcore

    ringcore.init()
    if ringcore.rank() == 1:
        raise KeyError("no such feature column")


# ---------------------------------------------------------------- configs (no Ray needed)


@pytest.mark.parametrize("num_workers", [0, -1, 1.5, True, "2"])
def test_scaling_config_rejects_num_workers_that_is_not_a_positive_integer(num_workers):
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        ScalingConfig(num_workers=num_workers)


def test_scaling_config_rejects_gpu_resources_without_use_gpu():
    with pytest.raises(ValueError, match="use_gpu=True"):
        ScalingConfig(num_workers=2, resources_per_worker={"GPU": 1})


def test_scaling_config_rejects_negative_resources_and_unknown_strategy():
    with pytest.raises(ValueError, match=r"resources_per_worker\['CPU'\]"):
        ScalingConfig(resources_per_worker={"CPU": -1})
    with pytest.raises(ValueError, match="placement_strategy"):
        ScalingConfig(placement_strategy="TIGHT")


def test_scaling_config_accepts_an_elastic_range_and_rejects_datasets_with_it(ray_cluster):
    assert ScalingConfig(num_workers=(1, 4)).elastic
    with pytest.raises(ValueError, match="elastic"):
        RingTrainer(
            _always_fails_loop,
            scaling_config=ScalingConfig(num_workers=(1, 2)),
            datasets={"train": ray.data.range(4)},
        )


def test_trainer_rejects_datasets_that_are_not_ray_datasets():
    with pytest.raises(TypeError, match=r"datasets\['train'\] is a list"):
        RingTrainer(_always_fails_loop, datasets={"train": [1, 2]})


def test_cuda_visible_devices_lists_every_gpu_of_the_workers_node():
    from ray_runner._cluster import cuda_visible_devices

    assert cuda_visible_devices(["a", "a", "b", "b"], [[1], [0], ["3"], [2]]) == [
        "0,1",
        "0,1",
        "2,3",
        "2,3",
    ]


def test_scaling_config_derives_per_worker_resources():
    sc = ScalingConfig(
        num_workers=2, use_gpu=True, resources_per_worker={"CPU": 2, "GPU": 0.5, "ssd": 1}
    )
    assert (sc.cpus_per_worker, sc.gpus_per_worker, sc.extra_resources) == (2, 0.5, {"ssd": 1})
    assert (
        ScalingConfig().num_workers,
        ScalingConfig().cpus_per_worker,
        ScalingConfig().gpus_per_worker,
    ) == (2, 1, None)


@pytest.mark.parametrize("max_failures", [-2, 1.0, None])
def test_failure_config_rejects_max_failures_below_minus_one_or_not_int(max_failures):
    with pytest.raises(ValueError, match="max_failures must be an integer >= -1"):
        FailureConfig(max_failures=max_failures)


@pytest.mark.parametrize("num_to_keep", [0, -3, 2.5])
def test_checkpoint_config_rejects_num_to_keep_below_one(num_to_keep):
    with pytest.raises(ValueError, match="num_to_keep must be None"):
        CheckpointConfig(num_to_keep=num_to_keep)


def test_run_config_rejects_bad_name_and_nested_config_types():
    with pytest.raises(ValueError, match=r"RunConfig\.name"):
        RunConfig(name="a/b")
    with pytest.raises(ValueError, match="failure_config must be a FailureConfig"):
        RunConfig(failure_config={"max_failures": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="verbose"):
        RunConfig(verbose=2)


def test_configs_are_frozen():
    with pytest.raises(AttributeError):
        ScalingConfig().num_workers = 3  # type: ignore[misc]
    with pytest.raises(AttributeError):
        RunConfig().name = "x"  # type: ignore[misc]


def test_trainer_rejects_a_config_for_a_loop_that_takes_no_argument():
    with pytest.raises(ValueError, match=r"train_loop_per_worker\(config\)"):
        RingTrainer(_always_fails_loop, train_loop_config={"lr": 0.1})


def test_executor_needs_exactly_one_of_num_workers_and_num_hosts():
    with pytest.raises(ValueError, match="exactly one of num_workers"):
        RayExecutor()
    with pytest.raises(ValueError, match="exactly one of num_workers"):
        RayExecutor(num_workers=2, num_hosts=1)
    with pytest.raises(ValueError, match="num_workers must be an integer >= 1"):
        RayExecutor(num_workers=0)


def test_report_outside_a_training_loop_raises_ring_error():
    with pytest.raises(ringcore.RingError, match="outside a training loop"):
        ray_runner.report({"loss": 1.0})
    with pytest.raises(ringcore.RingError, match="outside a training loop"):
        ray_runner.get_context()


def test_checkpoint_store_numbers_checkpoints_and_keeps_the_latest_num_to_keep(tmp_path):
    store = CheckpointStore(str(tmp_path / "run"), num_to_keep=2)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(3):
        (src / "it").write_text(str(i))
        persisted = store.persist(Checkpoint.from_directory(src))
        assert os.path.basename(persisted.path) == f"checkpoint_{i:06d}"
    assert [i for i, _ in store.indexed()] == [1, 2]
    assert sorted(os.listdir(tmp_path / "run")) == [
        ".ringtrain",  # the commit records
        "checkpoint_000001",
        "checkpoint_000002",
    ]
    latest = store.latest()
    assert latest is not None and (tmp_path / "run" / "checkpoint_000002" / "it").read_text() == "2"
    copied = latest.to_directory(str(tmp_path / "copy"))
    with open(os.path.join(copied, "it")) as fh:
        assert fh.read() == "2"


def test_training_failed_error_survives_pickling_with_its_worker_error():
    import pickle

    err = TrainingFailedError(WorkerError(1, "10.0.0.2", "KeyError", "'x'", "Traceback ..."), 2, 1)
    back = pickle.loads(pickle.dumps(err))
    assert (back.worker_error.rank, back.attempts, back.max_failures) == (1, 2, 1)
    assert isinstance(back, ringcore.RingError) and "rank 1 on host 10.0.0.2" in str(back)


def test_import_ray_runner_pulls_in_neither_pyspark_nor_estimators_nor_torch():
    code = "import sys, ray_runner; print(sorted({'pyspark', 'estimators', 'torch'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_start_without_ray_initialized_says_to_call_ray_init():
    code = (
        "from ray_runner import RayExecutor\n"
        "try:\n    RayExecutor(num_workers=1).start()\n"
        "except Exception as exc:\n    print(type(exc).__name__, exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.startswith("RingError Ray is not initialized")
    assert "ray.init()" in out.stdout


# ------------------------------------------------------------------------- RayExecutor


@pytest.mark.ray
class TestRayExecutorWithTwoWorkers:
    def test_run_returns_results_ordered_by_rank_with_local_ranks_of_one_node(self, executor):
        results = executor.run(_where_am_i)
        assert [r["rank"] for r in results] == [0, 1]
        assert [r["size"] for r in results] == [2, 2]
        assert [(r["local_rank"], r["local_size"]) for r in results] == [(0, 2), (1, 2)]
        assert [r["host"] for r in results] == executor.hosts
        assert len(set(executor.hosts)) == 1

    def test_allreduce_inside_run_gives_the_sum_over_both_ranks(self, executor):
        results = executor.run(_allreduce_sum, args=(2.0,))
        # rank 0 sends [2, 1], rank 1 sends [4, 1]
        assert results == [(0, [6.0, 2.0]), (1, [6.0, 2.0])]

    def test_run_passes_args_and_kwargs(self, executor):
        assert executor.run(
            lambda a, b=0: a + b + int(os.environ["RING_RANK"]), args=[10], kwargs={"b": 5}
        ) == [15, 16]

    def test_execute_calls_fn_with_each_workers_executable(self, executor):
        assert executor.execute(lambda ex: (ex.tag, int(os.environ["RING_RANK"]))) == [
            ("tagged", 0),
            ("tagged", 1),
        ]

    def test_execute_single_runs_on_rank_zero_only(self, executor):
        assert executor.execute_single(lambda ex: (ex.tag, int(os.environ["RING_RANK"]))) == (
            "tagged",
            0,
        )

    def test_failing_worker_raises_worker_error_with_rank_host_and_traceback(self, executor):
        with pytest.raises(WorkerError) as info:
            executor.run(_raise_on_rank_one)
        err = info.value
        assert (err.rank, err.host, err.error_type) == (1, executor.hosts[1], "ValueError")
        assert err.message == "boom on rank 1"
        assert "_raise_on_rank_one" in err.traceback
        assert "rank 1 on host" in str(err)

    def test_run_remote_refs_raise_an_instance_of_worker_error(self, executor):
        refs = executor.run_remote(_raise_on_rank_one)
        assert ray.get(refs[0]) == "fine"
        with pytest.raises(WorkerError) as info:
            ray.get(refs[1])
        assert info.value.rank == 1 and "boom on rank 1" in str(info.value)


@pytest.mark.ray
def test_shutdown_kills_the_actors_and_removes_the_placement_group(ray_cluster):
    ex = RayExecutor(num_workers=1)
    try:
        ex.start()
        actor, pg = ex.workers[0], ex._pg
        assert ex.run(_init_and_size) == [1]  # one rank: no TCP store needed
    finally:
        ex.shutdown()
    assert ray.util.placement_group_table(pg)["state"] == "REMOVED"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(actor.node_ip.remote(), timeout=60)
    with pytest.raises(ringcore.RingError, match="not started"):
        ex.run(_where_am_i)


@pytest.mark.ray
def test_worker_process_that_dies_reaches_the_driver_as_worker_error(ray_cluster):
    with RayExecutor(num_workers=1) as ex, pytest.raises(WorkerError) as info:
        ex.run(os._exit, args=(3,))
    assert (info.value.rank, info.value.error_type) == (0, "ActorDiedError")
    assert "the worker actor died" in info.value.message


@pytest.mark.ray
def test_start_raises_placement_timeout_naming_the_resources_that_did_not_fit(ray_cluster):
    ex = RayExecutor(num_workers=2, cpus_per_worker=2, placement_group_timeout_s=1)
    with pytest.raises(PlacementGroupTimeoutError) as info:
        ex.start()
    message = str(info.value)
    assert "2 bundle(s) of {'CPU': 2}" in message
    assert "{'CPU': 2.0} in total" in message
    assert "placement_group_timeout_s" in message
    assert ex.workers == []


# ------------------------------------------------------------------------- RingTrainer


@pytest.mark.ray
def test_fit_reports_three_iterations_and_keeps_checkpoints_under_storage_path(
    ray_cluster, tmp_path, capsys
):
    trainer = RingTrainer(
        _three_iterations_loop,
        train_loop_config={"scale": 1.0},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="three",
            storage_path=str(tmp_path),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    assert result.metrics == {"iteration": 2, "loss": pytest.approx(1 / 3), "sum": 3.0}
    assert list(result.metrics_dataframe["iteration"]) == [0, 1, 2]
    assert len(result.metrics_dataframe) == 3
    assert result.error is None
    assert result.path == str(tmp_path / "three")
    assert result.checkpoint is not None and result.checkpoint.path == str(
        tmp_path / "three" / "checkpoint_000002"
    )
    assert (tmp_path / "three" / "checkpoint_000002" / "it").read_text() == "2"
    assert sorted(p.name for p in (tmp_path / "three").iterdir() if not p.name.startswith(".")) == [
        "checkpoint_000001",
        "checkpoint_000002",
    ]
    out = capsys.readouterr().out
    assert "[RingTrainer] iteration 3: iteration=2, loss=0.3333, sum=3" in out


@pytest.mark.ray
def test_fit_restarts_after_a_failure_and_the_new_group_resumes_from_the_latest_checkpoint(
    ray_cluster, tmp_path
):
    trainer = RingTrainer(
        _fails_once_loop,
        train_loop_config={"marker": str(tmp_path / "failed_once")},
        run_config=RunConfig(
            name="retry",
            storage_path=str(tmp_path),
            failure_config=FailureConfig(max_failures=1),
            verbose=0,
        ),
    )
    result = trainer.fit()
    assert (tmp_path / "failed_once").exists()
    # attempt 1 reported iterations 0 and 1 and died; attempt 2 resumed after checkpoint 1
    assert list(result.metrics_dataframe["iteration"]) == [0, 1, 2]
    assert result.metrics == {"iteration": 2, "resumed_from": 1}
    assert (
        result.checkpoint is not None
        and os.path.basename(result.checkpoint.path) == "checkpoint_000002"
    )


@pytest.mark.ray
def test_fit_raises_training_failed_error_carrying_the_failed_ranks_worker_error(
    ray_cluster, tmp_path
):
    trainer = RingTrainer(
        _always_fails_loop,
        run_config=RunConfig(
            storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=0), verbose=0
        ),
    )
    with pytest.raises(TrainingFailedError) as info:
        trainer.fit()
    err = info.value
    assert isinstance(err, ringcore.RingError) and err.attempts == 1
    assert (err.worker_error.rank, err.worker_error.error_type) == (1, "KeyError")
    assert "no such feature column" in str(err)
    assert "_always_fails_loop" in err.worker_error.traceback


@pytest.mark.ray
@pytest.mark.reliability(fault="a Ray actor killed mid-epoch (RingTrainer)", category="fault")
@pytest.mark.timeout(120)
def test_fit_resumes_from_the_latest_checkpoint_after_an_actor_is_killed_mid_epoch(
    ray_cluster, tmp_path, capsys, request
):
    trainer = RingTrainer(
        _killed_once_loop,
        train_loop_config={"marker": str(tmp_path / "killed_once")},
        run_config=RunConfig(
            name="killed", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=-1)
        ),
    )
    result = trainer.fit()
    assert (tmp_path / "killed_once").exists()
    assert list(result.metrics_dataframe["iteration"]) == [0, 1, 2]
    assert list(result.metrics_dataframe["start"]) == [0, 0, 2]  # resumed after checkpoint 1
    out = capsys.readouterr().out
    # the cause printed is the killed actor's ActorDiedError or, when a peer noticed first, its
    # RingInternalError; either way the driver names an error before restarting
    assert "ActorDiedError" in out or "RingInternalError" in out or "died" in out
    assert "restarting the workers from " + str(tmp_path / "killed" / "checkpoint_000001") in out
    record(request, note="the new group resumed from checkpoint 1")


@pytest.mark.ray
@pytest.mark.reliability(fault="a Ray actor killed mid-epoch (RingTrainer)", category="fault")
@pytest.mark.timeout(120)
def test_an_actor_killed_between_two_checkpoints_resumes_from_the_last_one_to_the_same_state(
    ray_cluster, tmp_path, capsys, request
):
    marker = tmp_path / "killed_between"
    trainer = RingTrainer(
        _killed_between_checkpoints_loop,
        train_loop_config={"marker": str(marker)},
        run_config=RunConfig(
            name="between", storage_path=str(tmp_path), failure_config=FailureConfig(max_failures=1)
        ),
    )
    result = trainer.fit()
    import json

    killed_at = json.loads(marker.read_text())
    # the kill fell inside epoch 1, with epoch 0 checkpointed and two steps of epoch 1 done
    assert (killed_at["epoch"], killed_at["step"]) == (1, 2)
    assert killed_at["total"] == sum(
        3 * _step_value(e, s) for e, s in [*((0, i) for i in range(4)), (1, 0), (1, 1)]
    )
    rows = [(m["epoch"], m["step"], m["start"]) for m in result.metrics_history]
    first = [(e, s) for e, s, start in rows if start == 0]
    resumed = [(e, s) for e, s, start in rows if start != 0]
    # the killed attempt got no further than epoch 1, step 1; it never checkpointed epoch 1
    assert (
        first[:MID_STEPS] == [(0, s) for s in range(MID_STEPS)] and (1, MID_STEPS - 1) not in first
    )
    assert all(e <= 1 for e, _ in first), first
    # the new group started at epoch 1 (checkpoint 0 + 1) and redid the whole of epoch 1
    assert {start for *_, start in rows if start != 0} == {1}, rows
    assert resumed == [(e, s) for e in (1, 2) for s in range(MID_STEPS)]
    out = capsys.readouterr().out
    assert "restarting the workers from " + str(tmp_path / "between" / "checkpoint_000000") in out
    # and ends where an uninterrupted run does: no step lost, none counted twice
    assert result.metrics["total"] == pytest.approx(_expected_mid_epoch_total())
    assert result.checkpoint is not None
    assert os.path.basename(result.checkpoint.path) == "checkpoint_000002"
    with result.checkpoint.as_directory() as path, open(os.path.join(path, "state.json")) as fh:
        assert json.load(fh) == {"epoch": 2, "total": pytest.approx(_expected_mid_epoch_total())}
    record(request, note="killed at epoch 1 step 2; the new group resumed from checkpoint 0")


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_training_failed_error_carries_every_failed_ranks_error(ray_cluster, tmp_path):
    trainer = RingTrainer(
        _every_rank_fails_loop, run_config=RunConfig(storage_path=str(tmp_path), verbose=0)
    )
    with pytest.raises(TrainingFailedError) as info:
        trainer.fit()
    errors = info.value.worker_errors
    assert [(e.rank, e.error_type) for e in errors] == [(0, "ValueError"), (1, "ValueError")]
    assert [e.message for e in errors] == ["bad shard on rank 0", "bad shard on rank 1"]
    assert "Also failed: rank" in str(info.value)


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_ray_dataset_is_split_over_the_workers_and_every_row_is_read_once_per_epoch(
    ray_cluster, tmp_path
):
    n = 64
    trainer = RingTrainer(
        _count_rows_loop,
        train_loop_config={"n": n, "epochs": 2},
        # half a CPU per worker leaves Ray Data a CPU for its read tasks
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path), verbose=0),
        datasets={"train": ray.data.range(n)},
    )
    history = trainer.fit().metrics_history
    assert [m["epoch"] for m in history] == [0, 1]
    assert all(m["every_row_once"] for m in history)
    assert [m["mine"] for m in history] == [n // 2, n // 2]  # equal shards


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_ring_trainer_as_a_tune_trainable_runs_a_two_trial_grid_search(ray_cluster, tmp_path):
    from ray import tune

    trainer = RingTrainer(
        _tuned_loop,
        scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 0.5}),
        run_config=RunConfig(storage_path=str(tmp_path / "ring"), verbose=0),
    )
    tuner = tune.Tuner(
        trainer.as_trainable(),
        param_space={"lr": tune.grid_search([0.1, 0.2])},
        tune_config=tune.TuneConfig(metric="loss", mode="min", max_concurrent_trials=1),
        run_config=tune.RunConfig(storage_path=str(tmp_path / "tune"), name="grid", verbose=0),
    )
    results = tuner.fit()
    assert len(results) == 2 and not results.errors
    by_lr = {r.config["lr"]: r.metrics for r in results}
    # each trial ran 2 ranks: the last loss is 2 (steps) x 2 (ranks) x lr
    assert by_lr[0.1]["loss"] == pytest.approx(0.4) and by_lr[0.2]["loss"] == pytest.approx(0.8)
    assert by_lr[0.1]["size"] == 2
    assert results.get_best_result().config["lr"] == 0.1
