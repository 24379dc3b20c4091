"""Horovod's call shapes on the runners and the estimator: what a Horovod script passes
either works or fails before any job with the ringtrain way named.

Real parts only: one local Ray instance (2 CPUs) and one Spark ``local[2]`` session, each
shared by the module and started only by the tests that need it. Worker functions are
module-level functions made of asserts, shipped to the actors by value.
"""

from __future__ import annotations

import json
import os

import _spark
import pytest
from _servers import local_ray

ray = pytest.importorskip("ray")

import spark_runner  # noqa: E402
from estimators import RingEstimator  # noqa: E402
from estimators._params import HOROVOD_ONLY_PARAMS  # noqa: E402
from ray_runner import ElasticRayExecutor, RayExecutor, RaySettings, ray_logger  # noqa: E402
from ringcore import RingError, WorkerError  # noqa: E402

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)
SHARED_RAY = True  # on the suite's shared local Ray instance (tests/_servers.py local_ray)

# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def ray_cluster():
    """The suite's shared local Ray instance, 2 CPUs (tests/_servers.py local_ray)."""
    with local_ray(__name__):  # the worker functions here travel by value
        yield


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


# --------------------------------------------------------------------------- worker functions

_IFACE_VARS = ("RING_IFACE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "RING_START_TIMEOUT")


def _ring_sum_and_env():
    """Form the ring, sum one per rank, and return what the launcher put into the env."""
    import torch

    import ringcore.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    rank = hvd.rank()
    hvd.shutdown()
    return rank, total, {k: os.environ.get(k) for k in _IFACE_VARS}


def _log_steps(steps):
    rank = int(os.environ["RING_RANK"])
    for step in range(steps):
        ray_logger.log({"rank": rank, "step": step})
    return rank


def _log_then_fail():
    ray_logger.log({"before": "failure"})
    raise RuntimeError("boom after logging")


def _elastic_fails():
    raise ValueError("elastic boom")


def _elastic_fn(tag):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    ray_logger.log({"tag": tag, "rank": hvd.rank()})
    total = hvd.allreduce(torch.ones(1), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "size": hvd.size(), "total": total, "tag": tag}


# --------------------------------------------------------------------------- Ray: settings


def test_create_settings_takes_horovods_arguments_and_maps_timeouts_and_nics():
    settings = RayExecutor.create_settings(
        timeout_s=45,
        ssh_identity_file="/nonexistent/key.pem",
        ssh_str="-----BEGIN KEY-----",
        placement_group_timeout_s=7,
        nics={"lo", "eth0"},
    )
    assert isinstance(settings, RaySettings)
    assert settings.nics == ("eth0", "lo")  # a set, sorted: the same on every run
    assert not os.path.exists("/nonexistent/key.pem")  # ssh_str is not written anywhere
    assert settings.worker_env() == {
        "RING_START_TIMEOUT": "45",
        "RING_IFACE": "eth0,lo",
        "GLOO_SOCKET_IFNAME": "eth0,lo",
        "NCCL_SOCKET_IFNAME": "eth0,lo",
    }
    executor = RayExecutor(settings, num_workers=2)
    assert executor.placement_group_timeout_s == 7 and executor.num_workers == 2


def test_create_settings_rejects_bad_nics_and_timeouts_naming_the_value():
    with pytest.raises(ValueError, match=r"nics=.*'eth 0'.*ip -br link"):
        RayExecutor.create_settings(nics=["eth 0"])
    with pytest.raises(TypeError, match="nics takes interface names"):
        RayExecutor.create_settings(nics=3)
    with pytest.raises(ValueError, match=r"timeout_s must be a positive number.*-1"):
        RayExecutor.create_settings(timeout_s=-1)


def test_settings_must_come_from_create_settings():
    with pytest.raises(TypeError, match=r"create_settings.*dict"):
        RayExecutor({"timeout_s": 30}, num_workers=2)


def test_the_worker_count_may_still_come_first_positionally():
    assert RayExecutor(3).num_workers == 3


def test_use_current_placement_group_false_always_makes_a_new_group():
    assert RayExecutor(num_workers=1, use_current_placement_group=False).placement_group is None


def test_workers_get_the_settings_nics_and_timeout_and_the_ring_forms_on_them(ray_cluster):
    settings = RayExecutor.create_settings(timeout_s=40, nics=["lo"])
    executor = RayExecutor(settings, num_workers=2)
    executor.start()
    try:
        results = executor.run(_ring_sum_and_env)
    finally:
        executor.shutdown()
    assert [(rank, total) for rank, total, _ in results] == [(0, 2.0), (1, 2.0)]
    for _, _, env in results:
        assert env == {
            "RING_IFACE": "lo",
            "GLOO_SOCKET_IFNAME": "lo",
            "NCCL_SOCKET_IFNAME": "lo",
            "RING_START_TIMEOUT": "40",
        }


# --------------------------------------------------------------------------- Ray: callbacks


def test_run_calls_every_callback_with_every_value_the_ranks_log_in_that_run(ray_cluster):
    seen, counted = [], []
    executor = RayExecutor(RayExecutor.create_settings(), num_workers=2)
    executor.start()
    try:
        executor.run(_log_steps, args=[2])  # no callbacks: what it logs is dropped
        ranks = executor.run(
            _log_steps, args=[3], callbacks=[seen.append, lambda v: counted.append(1)]
        )
        assert ranks == [0, 1]
        # a second run starts from an empty queue: nothing of the first one is delivered again
        executor.run(_log_steps, kwargs={"steps": 1}, callbacks=[seen.append])
    finally:
        executor.shutdown()
    first = seen[:6]
    for rank in (0, 1):
        assert [v["step"] for v in first if v["rank"] == rank] == [0, 1, 2]  # in logged order
    assert len(counted) == 6
    assert sorted(v["rank"] for v in seen[6:]) == [0, 1]


def test_values_logged_before_a_rank_fails_still_reach_the_callbacks(ray_cluster):
    seen: list = []
    executor = RayExecutor(num_workers=1)
    executor.start()
    try:
        with pytest.raises(Exception, match="boom after logging"):
            executor.run(_log_then_fail, callbacks=[seen.append])
    finally:
        executor.shutdown()
    assert seen == [{"before": "failure"}]


def test_callbacks_must_be_a_list_of_callables():
    executor = RayExecutor(num_workers=1)
    with pytest.raises(TypeError, match=r"list of callables.*callbacks=\[fn\]"):
        executor.run(print, callbacks=print)
    with pytest.raises(TypeError, match=r"callbacks\[1\] is a int"):
        executor.run(print, callbacks=[print, 3])


def test_ray_logger_outside_a_worker_warns_once_and_drops_the_value(monkeypatch):
    monkeypatch.setattr(ray_logger, "_warned", False)
    with pytest.warns(UserWarning, match="outside a RayExecutor worker") as caught:
        ray_logger.log({"x": 1})
        ray_logger.log({"x": 2})
    assert len([w for w in caught if "ray_logger.log" in str(w.message)]) == 1
    assert ray_logger.drain() == []


# --------------------------------------------------------------------------- Ray: elastic


def test_elastic_ray_executor_runs_horovods_usage_and_feeds_the_callbacks(ray_cluster):
    settings = ElasticRayExecutor.create_settings(verbose=True)
    executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1)
    executor.start()
    seen: list = []
    try:
        results = executor.run(lambda: _elastic_fn("horovod"), callbacks=[seen.append])
    finally:
        executor.shutdown()
    # max_workers=None: as many as the cluster holds (2 CPUs, 1 per slot)
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["size"] == 2 and r["total"] == 2.0 for r in results)
    assert sorted(v["rank"] for v in seen) == [0, 1]


def test_ray_executor_with_min_and_max_workers_is_elastic(ray_cluster):
    settings = RayExecutor.create_settings(nics={"lo"})
    executor = RayExecutor(settings, min_workers=1, max_workers=2, cpus_per_worker=1)
    executor.start()
    try:
        results = executor.run(_elastic_fn, args=["ours"])
        with pytest.raises(NotImplementedError, match=r"run_remote.*elastic.*run\(fn"):
            executor.run_remote(_elastic_fn)
        with pytest.raises(NotImplementedError, match="execute_single"):
            executor.execute_single(print)
    finally:
        executor.shutdown()
    assert {r["size"] for r in results} == {len(results)} and 1 <= len(results) <= 2
    assert [r["rank"] for r in results] == list(range(len(results)))


def test_an_elastic_workers_exception_reaches_the_driver_with_its_rank(ray_cluster):
    settings = ElasticRayExecutor.create_settings(min_num_proc=1, max_num_proc=1)
    executor = ElasticRayExecutor(settings)
    with pytest.raises(RingError, match=r"not started; call start\(\) first"):
        executor.run(_elastic_fails)
    executor.start()
    with pytest.raises(WorkerError, match="elastic boom") as caught:
        executor.run(_elastic_fails)
    assert caught.value.rank == 0 and caught.value.error_type == "ValueError"


def test_elastic_ray_executor_takes_only_its_own_settings():
    with pytest.raises(TypeError, match=r"ElasticRayExecutor.create_settings.*dict"):
        ElasticRayExecutor({"min_num_proc": 1})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_workers": 2}, "max_workers=2 was given without min_workers"),
        ({"min_workers": 1, "num_workers": 2}, "not both"),
        ({"min_workers": 0}, r"min_workers must be an integer >= 1, got 0"),
        ({"min_workers": 2, "max_workers": 1}, r"max_workers must be None .* >= min_workers=2"),
        ({"min_workers": 1, "reset_limit": -1}, r"reset_limit must be None or an integer >= 0"),
        ({"min_workers": 1, "cooldown_range": (10,)}, r"cooldown_range must be \(min_seconds"),
        ({"min_workers": 1, "override_discovery": False}, "override_discovery=False"),
        ({"num_workers": 2, "reset_limit": 3}, "apply to an elastic job"),
    ],
)
def test_elastic_arguments_are_checked_before_anything_starts(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RayExecutor(**kwargs)


def test_elastic_create_settings_takes_horovods_arguments_and_deprecated_spellings():
    settings = ElasticRayExecutor.create_settings(
        min_np=2, max_np=4, reset_limit=3, elastic_timeout=60, nics="lo", verbose=2, ssh_port=22
    )
    assert (settings.min_num_proc, settings.max_num_proc, settings.reset_limit) == (2, 4, 3)
    executor = ElasticRayExecutor(settings, cooldown_range=(1, 10))
    assert (executor.min_workers, executor.max_workers, executor.elastic_timeout) == (2, 4, 60)
    assert executor._worker_env()["RING_ELASTIC_TIMEOUT"] == "60"
    with pytest.raises(TypeError, match=r"output_filename.*min_num_proc"):
        ElasticRayExecutor.create_settings(output_filename="x.log")


def test_reset_limit_stops_the_job_when_the_ring_would_be_re_formed_once_too_often():
    import torch.distributed as dist

    from ringcore.launch import ElasticDriver as _LimitedDriver

    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    alive = (["a", "b"], ["127.0.0.1", "127.0.0.1"])
    driver = _LimitedDriver(store, lambda: alive, min_workers=1, reset_limit=1)
    driver.start(["a", "b"])
    driver.publish(*alive)  # the first re-formation: within the limit
    assert json.loads(store.get("elastic/world/1"))["workers"] == ["a", "b"]
    driver.publish(*alive)  # the second: one too many
    world = json.loads(store.get("elastic/world/2"))
    assert "more than reset_limit=1" in world["abort"]


# --------------------------------------------------------------------------- Spark runner


@pytest.mark.spark
def test_spark_run_sets_the_data_plane_interface_of_every_task_from_nics(spark):
    results = spark_runner.run(
        _ring_sum_and_env, num_proc=2, nics={"lo"}, use_gloo=True, use_mpi=None, verbose=0
    )
    assert [(rank, total) for rank, total, _ in results] == [(0, 2.0), (1, 2.0)]
    for _, _, env in results:
        assert (env["RING_IFACE"], env["GLOO_SOCKET_IFNAME"], env["NCCL_SOCKET_IFNAME"]) == (
            "lo",
            "lo",
            "lo",
        )


@pytest.mark.parametrize("launch", [spark_runner.run, spark_runner.run_elastic])
@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"use_mpi": True}, r"use_mpi=True: MPI under Spark is not supported.*Gloo"),
        ({"extra_mpi_args": "-x NCCL_DEBUG"}, r"extra_mpi_args=.*MPI under Spark is not supported"),
        ({"use_gloo": False}, r"use_gloo=False"),
        ({"nics": ["eth0,eth1"]}, r"nics=.*no commas"),
        ({"nics": {"lo"}, "env": {"GLOO_SOCKET_IFNAME": "eth0"}}, r"both choose the data-plane"),
    ],
)
def test_spark_launchers_refuse_mpi_and_bad_nics_before_any_job(launch, kwargs, message):
    # No SparkSession is needed: the options are checked before the cluster is looked at.
    with pytest.raises(ValueError, match=message):
        launch(_ring_sum_and_env, num_proc=2, **kwargs)


def test_spark_run_refuses_another_interpreter_naming_the_spark_setting():
    with pytest.raises(ValueError, match=r"executable=.*spark.pyspark.python"):
        spark_runner.run(_ring_sum_and_env, num_proc=2, executable="/usr/bin/python2")


def test_run_elastic_takes_horovods_deprecated_min_np_and_refuses_a_conflict():
    from spark_runner._elastic import _deprecated_alias

    with pytest.warns(DeprecationWarning, match="min_np is deprecated, use min_num_proc"):
        assert _deprecated_alias("min_np", 2, "min_num_proc", None) == 2
    assert _deprecated_alias("max_np", None, "max_num_proc", 4) == 4
    with pytest.raises(ValueError, match="min_np=1 and min_num_proc=2 disagree"):
        spark_runner.run_elastic(_ring_sum_and_env, min_np=1, min_num_proc=2)


# --------------------------------------------------------------------------- estimator params


@pytest.mark.parametrize("spec", HOROVOD_ONLY_PARAMS, ids=lambda s: s.name)
def test_every_horovod_only_param_names_the_ringtrain_way_instead_of_unknown(spec):
    value = object()  # not Horovod's default: must be refused with an explanation
    with pytest.raises(ValueError) as caught:
        RingEstimator(**{spec.name: value})
    text = str(caught.value)
    assert spec.name in text and "unknown param" not in text
    with pytest.raises(ValueError, match=spec.name):
        getattr(RingEstimator(), f"set{''.join(p.title() for p in spec.name.split('_'))}")(value)


def test_horovod_only_params_at_their_horovod_defaults_are_accepted():
    from ringcore.torch import Compression

    est = RingEstimator(
        backend=None,
        reader_pool_type="thread",
        gradient_compression=Compression.none,
        tensorflow_dataset_prefetch_buffer_size=0,
        log_every_n_steps=50,
        custom_objects={},
        batch_size=8,
    )
    assert est.getBatchSize() == 8
    assert est.setBackend(None) is est


def test_horovod_params_with_a_clear_counterpart_are_mapped():
    assert RingEstimator(num_gpus=0).getUseGpu() is False
    assert RingEstimator(num_gpus=1).getUseGpu() is True
    with pytest.raises(ValueError, match="one GPU"):
        RingEstimator(num_gpus=2)
    with pytest.raises(ValueError, match="pass only use_gpu"):
        RingEstimator(num_gpus=1, use_gpu=False)


def test_specific_horovod_params_say_what_to_do_instead():
    with pytest.raises(ValueError, match=r"backend.*spark_runner\.run.*num_proc"):
        RingEstimator(backend="SparkBackend")


def test_horovods_reader_params_are_params_of_ours():
    est = RingEstimator(reader_pool_type="process", partitions_per_process=4)
    assert est.getReaderPoolType() == "process" and est.getPartitionsPerProcess() == 4
    assert est.setValReaderNumWorkers(3).getValReaderNumWorkers() == 3


def test_set_params_sets_several_params_with_the_constructors_checks():
    est = RingEstimator().setParams(batch_size=4, epochs=3, reader_pool_type="thread")
    assert (est.getBatchSize(), est.getEpochs()) == (4, 3)
    with pytest.raises(TypeError, match=r"unknown param.*epoch_count"):
        est.setParams(epoch_count=2)


# --------------------------------------------------------------------------- fit_on_parquet


def test_fit_on_parquet_by_dataset_idx_needs_a_store_and_names_what_the_store_holds(tmp_path):
    with pytest.raises(ValueError, match=r"no store is set.*store=Store.create"):
        RingEstimator().fit_on_parquet(dataset_idx=0)
    with pytest.raises(ValueError, match=r"dataset_idx=3.*holds no prepared data"):
        RingEstimator(store=str(tmp_path)).fit_on_parquet(dataset_idx=3)
    with pytest.raises(ValueError, match=r"dataset_idx must be an integer >= 0"):
        RingEstimator(store=str(tmp_path)).fit_on_parquet(dataset_idx=-1)
    with pytest.raises(ValueError, match="pass one"):
        RingEstimator(store=str(tmp_path)).fit_on_parquet("some/path", dataset_idx=0)


@pytest.mark.spark
def test_fit_on_parquet_takes_horovods_call_shape_and_reads_the_stores_prepared_data(
    spark, tmp_path
):
    import torch
    from pyspark.sql import functions as F

    from estimators import Store

    store = Store.create(str(tmp_path))
    rows = spark.range(128).select(
        F.array(*[(F.col("id") % (i + 2)).cast("float") for i in range(3)]).alias("features"),
        (F.col("id") % 2).cast("float").alias("y"),
    )
    # Where Horovod's default dataset_idx=None reads: the unnumbered intermediate data
    rows.repartition(2).write.parquet(f"{tmp_path}/intermediate_train_data")
    rows.limit(32).repartition(2).write.parquet(f"{tmp_path}/intermediate_val_data")
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    est = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(),
        feature_cols=["features"],
        label_cols=["y"],
        batch_size=16,
        epochs=1,
        num_proc=2,
        store=store,
        verbose=0,
    )
    trained = est.fit_on_parquet({est.epochs: 2})  # Horovod: fit_on_parquet(params)
    history = trained.getHistory()
    assert [e["epoch"] for e in history] == [1, 2] and "val_loss" in history[-1]


def test_the_migration_guide_lists_every_horovod_only_param():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[2] / "docs" / "migrating-from-horovod.md").read_text()
    missing = [p.name for p in HOROVOD_ONLY_PARAMS if f"| `{p.name}` |" not in text]
    assert missing == [], "add these to the Horovod param table of docs/migrating-from-horovod.md"
