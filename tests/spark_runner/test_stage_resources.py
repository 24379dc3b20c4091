"""``spark_runner.run(resources=..., use_gpu=...)``: the barrier stage asks for its GPUs
through a task ResourceProfile (Spark's stage-level scheduling), not through the
session's ``spark.task.resource.gpu.amount``.

One ``local-cluster[2,2,1024]`` session whose two workers each advertise one fake GPU
(a discovery script that hands out "0", then "1"; the executors get
``spark.executor.resource.gpu.amount=1``, the tasks nothing globally): 4 CPU slots, 2
GPU slots. Before it, a ``local[2]`` session in the same JVM shows the fallback where
Spark has no stage-level scheduling. No CUDA anywhere: the GPUs are Spark's.
"""

from __future__ import annotations

import logging
import os
import sys
import time

import _torch_programs  # its functions travel to the executors by value
import pytest

import spark_runner
from spark_runner._resources import ResourceSource, StageResourcesError, stage_resources
from spark_runner._slots import NotEnoughSlotsError, task_slots, wait_for_slots

pytestmark = [pytest.mark.spark, pytest.mark.timeout(300)]

#: a worker's discovery script: the next free fake GPU address, under a lock, so the two
#: workers of the cluster (threads of the driver's JVM, the same cwd) get distinct ones
DISCOVERY_SCRIPT = """#!{python}
import fcntl, json
with open({lock!r}, "a+") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    f.seek(0)
    taken = len(f.read())
    f.write("x")
print(json.dumps({{"name": "gpu", "addresses": [str(taken)]}}))
"""


@pytest.fixture(scope="module")
def gpu_cluster(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fake-gpus")
    script = folder / "discover_gpu.py"
    script.write_text(DISCOVERY_SCRIPT.format(python=sys.executable, lock=str(folder / "taken")))
    script.chmod(0o755)
    spark = spark_runner.local_session(
        "local-cluster[2,2,1024]",
        app_name="ringtrain-stage-resources",
        conf={
            "spark.worker.resource.gpu.amount": "1",
            "spark.worker.resource.gpu.discoveryScript": str(script),
            "spark.executor.resource.gpu.amount": "1",
        },
        log_level="ERROR",
    )
    try:
        wait_for_slots(spark, 4, 120)  # both executors registered
        yield spark
    finally:
        spark.stop()


def _visible_gpus() -> str:
    return os.environ["CUDA_VISIBLE_DEVICES"]


def _meet(folder: str, parties: int, timeout_s: float = 30.0):
    """An ordinary stage's task: mark itself present, then wait (without Spark's
    barrier) until all ``parties`` tasks are present at once; yields whether they were."""

    def task(it):
        from pyspark import TaskContext

        open(os.path.join(folder, str(TaskContext.get().partitionId())), "w").close()
        deadline = time.monotonic() + timeout_s
        while len(os.listdir(folder)) < parties and time.monotonic() < deadline:
            time.sleep(0.05)
        yield len(os.listdir(folder)) >= parties

    return task


def test_on_a_local_master_use_gpu_falls_back_to_local_ranks_and_resources_are_refused():
    """Runs first, before the cluster session: ``local[2]`` has no stage-level scheduling."""
    spark = spark_runner.local_session("local[2]", log_level="ERROR")
    try:
        plan = stage_resources(spark, None, True)
        assert plan.source is ResourceSource.LOCAL_RANK and plan.profile is None
        assert "TaskResourceProfiles are only supported" in plan.describe()  # Spark's words
        sc = spark.sparkContext
        sc.setJobGroup("refused-on-local", "resources on local[2]")
        with pytest.raises(StageResourcesError) as info:
            spark_runner.run(_visible_gpus, num_proc=2, resources={"gpu": 1}, verbose=0)
        assert list(sc.statusTracker().getJobIdsForGroup("refused-on-local")) == []
        msg = str(info.value)
        assert "resources={'gpu': 1}" in msg and "only supported for Standalone" in msg
        assert "standalone, YARN or Kubernetes" in msg and "spark.task.resource" in msg
    finally:
        spark.stop()


def test_the_training_stage_gets_one_distinct_gpu_per_task_and_other_stages_every_cpu_slot(
    gpu_cluster, tmp_path, caplog
):
    sc = gpu_cluster.sparkContext
    with caplog.at_level(logging.INFO, logger="ringtrain.spark_runner"):
        visible = spark_runner.run(_visible_gpus, num_proc=2, resources={"gpu": 1})
    assert sorted(visible) == ["0", "1"]  # one address each, the two workers' own
    logged = caplog.text
    assert "cpus=1, gpu=1 from a task ResourceProfile on the barrier stage" in logged
    assert sc.getConf().get("spark.task.resource.gpu.amount") is None  # nothing global
    # an ordinary stage of the same application: 4 tasks at once on the 4 CPU slots
    assert task_slots(sc) == 4
    met = sc.parallelize(range(4), 4).mapPartitions(_meet(str(tmp_path), 4)).collect()
    assert met == [True] * 4


def test_torch_distributed_programs_run_unchanged_on_a_local_cluster_with_a_gpu_per_task(
    gpu_cluster,
):
    """DDP, FSDP2, Lightning's DDPStrategy and the HF Trainer (CPU tensors: the GPUs are
    fake) in the tasks of a stage that asked for one GPU each, on two executors."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    ranks = spark_runner.run(_torch_programs.run_all, num_proc=2, resources={"gpu": 1})
    assert set(ranks[0]) == set(_torch_programs.PROGRAMS)
    for name in ranks[0]:
        seen = [programs[name] for programs in ranks]
        assert [(r["rank"], r["world_size"]) for r in seen] == [(0, 2), (1, 2)], name
        assert seen[0]["digest"] == seen[1]["digest"], name


def test_use_gpu_true_asks_one_gpu_per_task_and_slots_are_counted_by_that_profile(gpu_cluster):
    plan = stage_resources(gpu_cluster, None, True)
    assert plan.source is ResourceSource.STAGE_PROFILE
    assert plan.request == {"cpus": 1.0, "gpu": 1.0}
    assert task_slots(gpu_cluster.sparkContext, plan.profile) == 2  # 2 workers x 1 GPU
    with pytest.raises(NotEnoughSlotsError) as info:
        wait_for_slots(gpu_cluster, 3, 0.5, plan)
    assert "needs 3 task slots for tasks of cpus=1, gpu=1 but the cluster has 2" in str(info.value)


@pytest.mark.parametrize(
    ("resources", "use_gpu", "expected"),
    [
        ({"gpu": 0}, None, ["resources={'gpu': 0}", "positive number", "leave 'gpu' out"]),
        (
            {"gpu": 5},
            None,
            ["resources={'gpu': 5}", "each executor has 1 gpu", "spark.executor.resource"],
        ),
        ({"tpu": 1}, None, ["unknown resource 'tpu'", "'cpus', 'gpu'"]),
        ({"cpus": 1.5}, None, ["'cpus' must be a whole number", "1.5"]),
        ({"gpu": 1}, False, ["asks for GPUs but use_gpu=False", "drop one"]),
    ],
)
def test_resources_the_cluster_cannot_give_are_refused_before_any_job(
    gpu_cluster, resources, use_gpu, expected
):
    sc = gpu_cluster.sparkContext
    sc.setJobGroup("refused", "bad resources")
    try:
        with pytest.raises(StageResourcesError) as info:
            spark_runner.run(
                _visible_gpus, num_proc=2, resources=resources, use_gpu=use_gpu, verbose=0
            )
        assert list(sc.statusTracker().getJobIdsForGroup("refused")) == []
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    for part in expected:
        assert part in str(info.value)
