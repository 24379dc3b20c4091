"""The GPU path of the runners and the estimator.

Tests marked ``gpu`` need a CUDA device and skip cleanly without one
(``bench/gpu_check.sh`` runs them on a GPU machine): ``RingEstimator(use_gpu=True)``
fit and transform on ``local[1]``, ``RingTrainer`` and ``RayExecutor`` with a GPU
from a local Ray. The others run everywhere: ``use_gpu=True`` where there is no GPU
is refused before any job, naming the option, the value and the fix; the device a
transform task or a Spark task picks.
"""

from __future__ import annotations

import io
import json
import os
import sys

import numpy as np
import pytest
import torch

from ringcore.launch import GpuUnavailableError

pytest.importorskip("pyspark")
ray = pytest.importorskip("ray")

from _digits import demo  # noqa: E402

import ray_runner  # noqa: E402
import spark_runner  # noqa: E402
from estimators import Callback, RingEstimator, RingModel, Store  # noqa: E402
from estimators.frameworks.torch._predict import task_device  # noqa: E402
from ray_runner import RayExecutor, RingTrainer, RunConfig, ScalingConfig  # noqa: E402
from spark_runner._task import gpu_env  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_NCCL = HAS_CUDA and torch.distributed.is_nccl_available()
needs_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="torch.cuda.is_available() is False: needs a CUDA device"
)
without_cuda = pytest.mark.skipif(
    HAS_CUDA, reason="checks the refusal where torch sees no CUDA device (and Ray no GPU)"
)

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def spark():
    session = spark_runner.local_session(
        "local[1]",
        app_name="test-gpu-runners",
        conf={
            "spark.sql.shuffle.partitions": "1",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "128",
        },
    )
    try:
        session.sparkContext.setLogLevel("FATAL")
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="module")
def ray_cluster():
    """A local Ray with the GPU this machine has (none without CUDA); always shut down."""
    owns = not ray.is_initialized()
    if owns:
        ray.init(
            address="local",
            num_cpus=2,
            num_gpus=1 if HAS_CUDA else 0,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
        )
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the loops below
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        if owns:
            ray.shutdown()


def _placement_groups() -> int:
    return len(ray.util.placement_group_table())


# ------------------------------------------------------------------ CPU-side (always)


class _Context:  # the one thing gpu_env reads from a TaskContext (a seam of ours)
    def __init__(self, resources: dict):
        self._resources = resources

    def resources(self) -> dict:
        return self._resources


class _Resource:
    def __init__(self, addresses: list[str]):
        self.addresses = addresses


def test_spark_tasks_count_local_ranks_within_the_executors_own_visible_gpus(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert gpu_env(_Context({}), True, 1)["CUDA_VISIBLE_DEVICES"] == "6"
    assert gpu_env(_Context({}), True, 2)["RING_GPU_ADDRESSES"] == "4"  # wraps around
    # what Spark assigned wins; use_gpu=False pins nothing
    assert gpu_env(_Context({"gpu": _Resource(["3"])}), True, 1)["CUDA_VISIBLE_DEVICES"] == "3"
    assert gpu_env(_Context({"gpu": _Resource(["3"])}), False, 1) == {}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert gpu_env(_Context({}), True, 1)["CUDA_VISIBLE_DEVICES"] == "1"


def test_a_transform_task_predicts_on_the_gpu_only_when_use_gpu_allows():
    assert task_device(False) == torch.device("cpu")
    # no TaskContext here: GPU 0 when CUDA is present, else the CPU
    assert task_device(None) == (torch.device("cuda", 0) if HAS_CUDA else torch.device("cpu"))
    if not HAS_CUDA:
        with pytest.raises(GpuUnavailableError) as info:
            task_device(True)
        msg = str(info.value)
        assert "RingModel.transform: use_gpu=True" in msg
        assert "CUDA build of torch" in msg and "use_gpu=False" in msg


@pytest.mark.spark
@pytest.mark.timeout(120)
def test_a_ring_model_keeps_use_gpu_through_save_and_load(spark, tmp_path):
    common = {
        "model": torch.nn.Linear(3, 1),
        "feature_cols": ["x"],
        "label_cols": ["y"],
        "feature_shapes": [[3]],
    }
    assert RingModel(**common).getUseGpu() is None  # the default: a GPU when a task sees one
    RingModel(use_gpu=True, **common).save(str(tmp_path / "on"))
    assert RingModel.load(str(tmp_path / "on")).getUseGpu() is True


@without_cuda
@pytest.mark.spark
@pytest.mark.timeout(120)
def test_ring_estimator_use_gpu_true_without_cuda_is_refused_before_any_job(spark, tmp_path):
    launched: list = []

    def launcher(fn, args, num_proc):  # the estimator's launch seam: records, runs nothing
        launched.append(fn)
        return []

    df = demo.digits_frame(spark)
    store = Store.create(str(tmp_path / "store"))
    est = demo.make_estimator(store, epochs=1).setUseGpu(True)
    est.launcher = launcher
    sc = spark.sparkContext
    sc.setJobGroup("gpu-refusal", "use_gpu=True without CUDA")
    try:
        with pytest.raises(ValueError) as info:
            est.fit(df)
        jobs = sc.statusTracker().getJobIdsForGroup("gpu-refusal")
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    msg = str(info.value)
    assert "use_gpu=True" in msg and "no CUDA device" in msg and "setUseGpu(False)" in msg
    assert launched == [] and list(jobs) == []
    assert not os.path.exists(store.get_train_data_path(0))


@without_cuda
@pytest.mark.ray
@pytest.mark.timeout(120)
def test_ray_use_gpu_true_on_a_cluster_without_gpus_is_refused_before_placing(
    ray_cluster, tmp_path
):
    groups = _placement_groups()
    executor = RayExecutor(num_workers=1, use_gpu=True, placement_group_timeout_s=60)
    with pytest.raises(GpuUnavailableError) as info:
        executor.start()
    msg = str(info.value)
    assert "RayExecutor: use_gpu=True but the Ray cluster has no GPUs" in msg
    assert "GPU=0" in msg and "--num-gpus" in msg and "use_gpu=False" in msg

    trainer = RingTrainer(
        _gpu_loop,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(name="refused", storage_path=str(tmp_path), verbose=0),
    )
    with pytest.raises(GpuUnavailableError, match=r"RingTrainer \(ScalingConfig\): use_gpu=True"):
        trainer.fit()
    assert _placement_groups() == groups  # nothing was placed
    assert not (tmp_path / "refused").exists()  # nor a run folder made


# ---------------------------------------------------------------- on a GPU (gpu marker)


def _tagged_mlp() -> torch.nn.Module:
    """Digits' 64-32-10 MLP plus an 11th output column saying where it ran (1.0: a GPU).
    Made inside a function so that cloudpickle ships the class to the workers."""

    class TaggedMLP(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
            )

        def forward(self, x):
            out = self.net(x)
            tag = torch.full((len(x), 1), float(out.is_cuda), dtype=out.dtype, device=out.device)
            return torch.cat([out, tag], dim=1)

    torch.manual_seed(0)
    return TaggedMLP()


def _device_recorder(path: str) -> Callback:
    class DeviceRecorder(Callback):
        def on_train_begin(self, logs):
            import ringcore.launch

            facts = {
                "params": sorted({str(p.device) for p in self.model.parameters()}),
                "current": torch.cuda.current_device() if torch.cuda.is_available() else None,
                "backend": ringcore.launch.backend_name(),
            }
            with open(path, "w") as f:
                json.dump(facts, f)

    return DeviceRecorder()


def _tensor_devices(value) -> set[str]:
    if isinstance(value, torch.Tensor):
        return {value.device.type}
    if isinstance(value, dict):
        return set().union(set(), *(_tensor_devices(v) for v in value.values()))
    if isinstance(value, list | tuple):
        return set().union(set(), *(_tensor_devices(v) for v in value))
    return set()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.spark
@pytest.mark.timeout(300)
def test_ring_estimator_use_gpu_trains_and_transforms_on_the_gpu(spark, tmp_path):
    train_df, test_df = demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)
    store = Store.create(str(tmp_path / "store"))
    facts_path = str(tmp_path / "worker_device.json")
    model = _tagged_mlp()
    est = RingEstimator(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=3,
        num_proc=1,
        store=store,
        random_seed=demo.SEED,
        use_gpu=True,
        callbacks=[_device_recorder(facts_path)],
        verbose=0,
    )
    fitted = est.fit(train_df)
    with open(facts_path) as f:
        facts = json.load(f)
    assert facts["params"] == [f"cuda:{facts['current']}"]  # the model trained on the GPU
    if HAS_NCCL:
        assert facts["backend"] == "nccl"
    history = fitted.getHistory()
    assert len(history) == 3 and history[-1]["train_loss"] < history[0]["train_loss"]
    # the checkpoint holds CPU tensors only: a driver without a GPU loads it as is
    raw = store.read_bytes(store.get_checkpoint_path(fitted.getRunId()))
    checkpoint = torch.load(io.BytesIO(raw), weights_only=True)
    assert _tensor_devices(checkpoint["model"]) == {"cpu"}
    assert _tensor_devices(checkpoint["optimizer"]) == {"cpu"}
    cpu_model = fitted.getModel()
    assert {p.device.type for p in cpu_model.parameters()} == {"cpu"}
    assert fitted.getUseGpu() is True

    rows = fitted.transform(test_df).select("features", "label__output").collect()
    features = torch.tensor(np.array([r["features"].toArray() for r in rows]), dtype=torch.float32)
    outputs = np.array([r["label__output"] for r in rows])
    with torch.no_grad():
        expected = cpu_model(features).numpy()
    assert np.all(outputs[:, 10] == 1.0)  # the transform tasks ran the model on a GPU
    assert np.all(expected[:, 10] == 0.0)
    np.testing.assert_allclose(outputs[:, :10], expected[:, :10], rtol=1e-4, atol=1e-4)


def _gpu_loop(config=None):
    """RingTrainer's loop: a few steps of a linear model on the GPU ringcore pinned."""
    import torch.nn.functional as F

    import ringcore.launch
    import ringcore.torch as hvd

    hvd.init()
    dev = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1).to(dev)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    x = torch.randn(256, 8, device=dev)
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(20):
        opt.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    ray_runner.report(
        {
            "device": str(next(model.parameters()).device),
            "backend": ringcore.launch.backend_name(),
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "first_loss": losses[0],
            "last_loss": losses[-1],
        }
    )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.ray
@pytest.mark.timeout(180)
def test_ring_trainer_use_gpu_trains_on_the_gpu_ray_assigned(ray_cluster, tmp_path):
    result = RingTrainer(
        _gpu_loop,
        scaling_config=ScalingConfig(num_workers=1, use_gpu=True),
        run_config=RunConfig(name="gpu", storage_path=str(tmp_path), verbose=0),
    ).fit()
    m = result.metrics
    assert m is not None and m["device"].startswith("cuda")
    assert m["ray_gpu_ids"] and m["visible"] == ",".join(m["ray_gpu_ids"])
    if HAS_NCCL:
        assert m["backend"] == "nccl"
    assert m["last_loss"] < m["first_loss"]


def _executor_gpu_facts() -> dict:
    import ringcore.launch
    import ringcore.torch as hvd

    hvd.init()
    t = hvd.allreduce(torch.full((4,), 2.0, device="cuda"), op=hvd.Sum)
    return {
        "device": str(t.device),
        "sum": t.tolist(),
        "size": hvd.size(),
        "current": torch.cuda.current_device(),
        "backend": ringcore.launch.backend_name(),
        "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
    }


@pytest.mark.gpu
@needs_cuda
@pytest.mark.ray
@pytest.mark.timeout(180)
def test_ray_executor_use_gpu_pins_the_gpu_ray_assigned(ray_cluster):
    executor = RayExecutor(num_workers=1, use_gpu=True, placement_group_timeout_s=60)
    executor.start()
    try:
        (facts,) = executor.run(_executor_gpu_facts)
    finally:
        executor.shutdown()
    assert facts["device"] == f"cuda:{facts['current']}"
    assert facts["sum"] == [2.0 * facts["size"]] * 4
    assert facts["ray_gpu_ids"] and facts["visible"] == ",".join(facts["ray_gpu_ids"])
    if HAS_NCCL:
        assert facts["backend"] == "nccl"
