"""estimators.Store: local, fsspec (memory://, file://, by scheme) and DBFS stores."""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
import uuid

import _spark
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from estimators import DBFSLocalStore, FsspecStore, LocalStore, Store, VolumeStore, default_store

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)


@pytest.fixture
def memory_store():
    store = Store.create(f"memory://ringtrain-test-{uuid.uuid4().hex[:8]}")
    yield store
    store.rm(store.prefix_path)


def _checkpoint_round_trip(store: Store) -> None:
    path = store.get_checkpoint_path("r1")
    state = {"model": {"w": torch.arange(3.0)}, "epoch": 2}
    store.write_atomic(path, lambda f: torch.save(state, f))
    loaded = torch.load(io.BytesIO(store.read_bytes(path)), weights_only=True)
    assert torch.equal(loaded["model"]["w"], state["model"]["w"]) and loaded["epoch"] == 2
    assert store.find_checkpoint("r1") == path


@pytest.mark.parametrize("kind", ["memory", "local", "fsspec-file"])
def test_the_store_api_writes_reads_checks_and_removes(kind, memory_store, tmp_path):
    store = {
        "memory": memory_store,
        "local": Store.create(str(tmp_path)),
        "fsspec-file": FsspecStore("file://" + str(tmp_path)),
    }[kind]
    history = store.get_history_path("r1")
    assert history == f"{store.prefix_path}/runs/r1/logs/history.json"
    assert not store.exists(history) and store.find_checkpoint("r1") is None
    store.write_json(history, [{"epoch": 1}])
    assert store.exists(history) and store.read_json(history) == [{"epoch": 1}]
    _checkpoint_round_trip(store)
    store.rm(store.get_run_path("r1"))
    assert not store.exists(store.get_run_path("r1"))
    store.rm(store.get_run_path("never-there"))  # nothing to remove is fine


@pytest.mark.reliability(fault="a checkpoint writer SIGKILLed mid-write", category="fault")
@pytest.mark.parametrize("kind", ["local", "fsspec-file"])
def test_a_write_removes_only_dead_writers_temp_files_never_a_live_writers(kind, tmp_path):
    store = Store.create(str(tmp_path)) if kind == "local" else FsspecStore(f"file://{tmp_path}")
    path = f"{store.get_run_path('r1')}/ckpt[ab].pt"  # glob characters in the path
    store.write_atomic(path, lambda f: f.write(b"epoch 1"))
    dead = [f"{path}.tmp-0badf00d", f"{path}.tmp-4242-0badf00d"]  # what killed writers left
    kept = [f"{path}.tmp-notours", f"{store.get_run_path('r1')}/ckpta.pt.tmp-0badf00d"]
    for name in dead + kept:
        with open(name.removeprefix("file://"), "wb") as f:
            f.write(b"half")
    inside, go, errors = threading.Event(), threading.Event(), []

    def paused(f) -> None:  # a live writer of the same path, inside its write
        f.write(b"epoch 3, ")
        inside.set()
        assert go.wait(30)
        f.write(b"whole")

    def live() -> None:
        try:
            store.write_atomic(path, paused)
        except Exception as exc:
            errors.append(exc)

    writer = threading.Thread(target=live)
    writer.start()
    assert inside.wait(30)
    store.write_atomic(path, lambda f: f.write(b"epoch 2"))  # and its cleanup
    assert store.read_bytes(path) == b"epoch 2"
    go.set()
    writer.join(30)
    assert errors == [] and store.read_bytes(path) == b"epoch 3, whole"  # its file was its own
    assert all(store.exists(name) for name in kept)
    # a dead writer is told by its lock, which needs a local filesystem; an object store
    # leaves them (a run checkpoint's go with its writer's folder: test_checkpoint_fencing)
    assert not any(store.exists(name) for name in dead) if kind == "local" else True


def test_memory_store_serves_parquet_to_pyarrow_and_copies_it_to_local_disk(memory_store):
    path = memory_store.get_train_data_path(memory_store.next_data_index())
    table = pa.table({"x": pa.array([[1.0, 2.0]] * 5, type=pa.list_(pa.float32()))})
    for i in range(2):
        memory_store.write_atomic(f"{path}/part-{i}.parquet", lambda f: pq.write_table(table, f))
    assert memory_store.next_data_index() == 1
    assert memory_store.parquet_dataset(path).count_rows() == 10
    local = memory_store.localize(path)
    assert sorted(os.listdir(local)) == ["part-0.parquet", "part-1.parquet"]
    np.testing.assert_array_equal(pq.read_table(local).column("x").to_pylist()[0], [1.0, 2.0])
    assert not memory_store.spark_can_write and not memory_store.is_local()


@pytest.mark.parametrize(
    ("url", "spark_url"),
    [
        ("s3://bucket/prefix", "s3a://bucket/prefix/intermediate_train_data.0"),
        ("gs://bucket/prefix", "gs://bucket/prefix/intermediate_train_data.0"),
        ("hdfs://namenode:8020/prefix", "hdfs://namenode:8020/prefix/intermediate_train_data.0"),
        (
            "abfs://c@acct.dfs.core.windows.net/p",
            "abfs://c@acct.dfs.core.windows.net/p/intermediate_train_data.0",
        ),
    ],
)
def test_fsspec_urls_make_fsspec_stores_with_their_options_and_spark_urls(url, spark_url):
    store = Store.create(url + "/", storage_options={"anon": True})
    assert isinstance(store, FsspecStore) and store.prefix_path == url
    assert store.storage_options == {"anon": True} and store.spark_can_write
    assert store.url(store.get_train_data_path(0)) == spark_url
    assert pickle.loads(pickle.dumps(store)) == store


def test_local_paths_and_file_urls_make_local_stores(tmp_path):
    assert Store.create("file://" + str(tmp_path)) == LocalStore(str(tmp_path))
    assert Store.create(str(tmp_path)).url(str(tmp_path / "a")) == "file://" + str(tmp_path / "a")


def test_dbfs_paths_map_to_the_fuse_root_on_databricks(monkeypatch, tmp_path):
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    with pytest.raises(ValueError, match="dbfs: paths need Databricks"):
        Store.create("dbfs:/ml/run")
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    monkeypatch.delenv("RING_DBFS_ROOT", raising=False)
    real = Store.create("dbfs:/ml/run")
    assert isinstance(real, DBFSLocalStore) and real.prefix_path == "/dbfs/ml/run"
    assert real.url(real.get_train_data_path(0)) == "dbfs:/ml/run/intermediate_train_data.0"
    assert Store.create("/dbfs/ml/run") == real
    monkeypatch.setenv("RING_DBFS_ROOT", str(tmp_path))
    store = Store.create("dbfs:/ml/run")
    assert store.prefix_path == str(tmp_path / "ml" / "run")
    assert store.url(store.prefix_path) == "file://" + str(tmp_path / "ml" / "run")
    _checkpoint_round_trip(store)
    assert os.path.isfile(tmp_path / "ml" / "run" / "runs" / "r1" / "checkpoint" / "checkpoint.pt")


def test_volume_paths_make_volume_stores_on_databricks_that_spark_names_by_dbfs_url(
    monkeypatch, tmp_path
):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    monkeypatch.delenv("RING_VOLUMES_ROOT", raising=False)
    real = Store.create("/Volumes/main/ml/vol/runs_a")
    assert isinstance(real, VolumeStore) and real.prefix_path == "/Volumes/main/ml/vol/runs_a"
    assert real.volume == "main.ml.vol"
    assert real.url(real.get_train_data_path(0)) == (
        "dbfs:/Volumes/main/ml/vol/runs_a/intermediate_train_data.0"
    )
    assert Store.create("dbfs:/Volumes/main/ml/vol/runs_a") == real
    assert pickle.loads(pickle.dumps(real)) == real
    # emulated: the volume mount under a local root; Spark then writes file:// URLs
    monkeypatch.setenv("RING_VOLUMES_ROOT", str(tmp_path))
    store = Store.create("/Volumes/main/ml/vol/runs_a")
    assert store.prefix_path == str(tmp_path / "main" / "ml" / "vol" / "runs_a")
    assert store.url(store.prefix_path) == "file://" + store.prefix_path
    _checkpoint_round_trip(store)
    assert (tmp_path / "main/ml/vol/runs_a/runs/r1/checkpoint/checkpoint.pt").is_file()
    # off Databricks a /Volumes path is an ordinary local path
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION")
    assert type(Store.create("/Volumes/main/ml/vol/x")) is LocalStore


@pytest.mark.parametrize(
    ("path", "names"),
    [("/Volumes", "no catalog"), ("/Volumes/main", "<catalog> only"),
     ("/Volumes/main/ml", "<catalog>/<schema> only"), ("dbfs:/Volumes/main/ml/", "<schema> only")],
)  # fmt: skip
def test_a_volume_path_that_names_no_volume_is_refused_with_the_form(monkeypatch, path, names):
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    with pytest.raises(ValueError, match=r"/Volumes/<catalog>/<schema>/<volume>/<folder>") as err:
        Store.create(path)
    assert names in str(err.value) and "CREATE VOLUME" in str(err.value)


def test_the_default_store_is_a_temporary_directory_here_and_a_volume_on_databricks(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    here = default_store()
    try:
        assert type(here) is LocalStore and os.path.isdir(here.prefix_path)
    finally:
        here.rm(here.prefix_path)
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "16.4")
    monkeypatch.setenv("RING_VOLUMES_ROOT", str(tmp_path))
    monkeypatch.delenv("RING_DATABRICKS_VOLUME", raising=False)
    # no volume main.default.ringtrain: refused before any job, saying how to give one
    with pytest.raises(ValueError, match=r"has no store and the default /Volumes/main/default/"):
        default_store()
    (tmp_path / "main" / "default" / "ringtrain").mkdir(parents=True)
    store = default_store()
    assert isinstance(store, VolumeStore) and store.volume == "main.default.ringtrain"
    assert os.path.dirname(store.prefix_path) == str(tmp_path / "main/default/ringtrain")
    assert default_store() != store  # a new folder per fit
    monkeypatch.setenv("RING_DATABRICKS_VOLUME", "/Volumes/ml/team/scratch")
    with pytest.raises(ValueError, match=r"RING_DATABRICKS_VOLUME='/Volumes/ml/team/scratch'"):
        default_store()
    (tmp_path / "ml" / "team" / "scratch").mkdir(parents=True)
    assert default_store().volume == "ml.team.scratch"


def test_a_run_of_the_old_layout_still_finds_its_checkpoint(tmp_path):
    store = Store.create(str(tmp_path))
    store.write_bytes(store.get_legacy_checkpoint_path("old"), b"x")
    assert store.find_checkpoint("old") == str(tmp_path / "runs" / "old" / "checkpoint.pt")


def test_store_create_refuses_an_empty_prefix():
    with pytest.raises(ValueError, match="non-empty path or URL"):
        Store.create("")


# --- a whole fit through an fsspec store -------------------------------------------------------


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


def _tears_the_newest_checkpoint(store: Store, run_id: str):
    """A callback: rank 0, after the last epoch, cuts the run's newest checkpoint in half
    (what a crash of the store's host may leave)."""
    from estimators import Callback

    class Tear(Callback):
        def on_train_end(self, logs):
            if self.rank == 0:
                path = store.find_checkpoint(run_id)
                data = store.read_bytes(path)
                with store.fs.open(path, "wb") as f:
                    f.write(data[: len(data) // 2])

    return Tear()


@pytest.mark.spark
@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
def test_a_fit_through_an_fsspec_file_url_store_trains_and_loads_past_a_torn_checkpoint(
    spark, tmp_path, caplog
):
    from estimators import RingEstimator

    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 3))
    rows = [([float(v) for v in r], float(r.sum() > 0)) for r in x]
    df = spark.createDataFrame(rows, ["x", "y"])
    store = FsspecStore("file://" + str(tmp_path))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 1), torch.nn.Sigmoid())
    estimator = RingEstimator(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.05),
        loss=torch.nn.BCELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        validation=0.2,
        epochs=2,
        batch_size=16,
        num_proc=2,
        verbose=0,
        store=store,
        run_id="fsspec",
        random_seed=3,
        callbacks=[_tears_the_newest_checkpoint(store, "fsspec")],
    )
    with caplog.at_level(logging.WARNING, logger="ringtrain.estimators"):
        fitted = estimator.fit(df)
    assert [e["epoch"] for e in fitted.getHistory()] == [1, 2]
    assert store.read_json(store.get_history_path("fsspec")) == fitted.getHistory()
    # one folder per writer (the fit's stage attempt 0); the driver loaded past the newest
    # checkpoint, torn after the last epoch, to the previous one, and said so
    latest = store.find_checkpoint("fsspec")
    assert latest.startswith(f"{store.get_checkpoints_path('fsspec')}/writer-")
    assert latest.endswith("-0/checkpoint.pt.prev"), latest
    previous = torch.load(io.BytesIO(store.read_bytes(latest)), weights_only=True)
    assert previous["epoch"] == 1
    for name, value in previous["model"].items():
        assert torch.equal(fitted.getModel().state_dict()[name], value), name
    assert "checkpoint.pt is damaged" in caplog.text


def test_workers_read_a_remote_store_in_place_unless_it_asks_for_a_local_copy(tmp_path):
    from estimators.data._readers import data_paths

    data = tmp_path / "store" / "intermediate_train_data.0"
    data.mkdir(parents=True)
    pq.write_table(pa.table({"x": [1.0, 2.0]}), str(data / "part-0.parquet"))
    url = "file://" + str(data)
    in_place = FsspecStore("file://" + str(tmp_path / "store"))
    assert in_place.reads_in_place() and in_place.read_options() == {}
    with data_paths(in_place, url, None) as (train, val):
        assert (train, val) == (url, None)  # the store's own path: nothing copied
    copying = Store.create("s3://bucket/prefix", {"anon": True}, local_copy=True)
    assert isinstance(copying, FsspecStore) and not copying.reads_in_place()
    copying = FsspecStore("file://" + str(tmp_path / "store"), local_copy=True)
    with data_paths(copying, url, None) as (train, _):
        assert train != url and os.listdir(train) == ["part-0.parquet"]
    assert not os.path.exists(train)  # the copy is removed afterwards
    assert LocalStore(str(tmp_path)).reads_in_place()


def test_copy_and_writer_options_of_a_path_store_are_refused_naming_them(tmp_path):
    with pytest.raises(ValueError, match=r"local_copy=True.*for a remote fsspec URL"):
        Store.create(str(tmp_path), local_copy=True)
    with pytest.raises(ValueError, match="parquet_writer='arrow'"):
        Store.create("file://" + str(tmp_path), parquet_writer="arrow")
    with pytest.raises(ValueError, match="local_copy must be True or False"):
        FsspecStore("s3://bucket/p", local_copy="yes")
