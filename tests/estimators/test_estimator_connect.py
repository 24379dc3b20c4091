"""RingEstimator / RingModel on a Spark Connect session: a real Spark Connect server
started from the pyspark package (tests/_connect_server.py, ``local[2]``, 127.0.0.1), one
for the whole module. ``fit`` (the slots and ``num_proc`` from the server's conf, the
workers through ``mapInArrow(barrier=True)``), ``transform``, ``save`` / ``load`` of a
RingModel and of a fitted ``PipelineModel`` holding one, and what is refused on Connect
with the reason and the fix. The server and this client share the filesystem, so the
store and the save paths are plain local paths both reach."""

from __future__ import annotations

import glob
import os
import threading

import numpy as np
import pandas as pd
import pytest
import torch

pytest.importorskip("pyspark.sql.connect.session", reason="the Spark Connect client extras")

import _connect_server
import pyspark
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.feature import VectorAssembler
from pyspark.sql import SparkSession
from pyspark.sql import functions as F

import spark_runner
from estimators import RingEstimator, RingModel, Store

pytestmark = pytest.mark.spark
SHARED_CONNECT = True  # its server is tests/_connect_server.py's shared local[2] one

ROWS = 256
WEIGHTS = np.array([1.5, -2.0, 0.5, 1.0], dtype=np.float32)
_JARS = os.path.join(os.path.dirname(pyspark.__file__), "jars")


@pytest.fixture(scope="module")
def server_work(tmp_path_factory):
    """The Connect server's working directory (where a relative path lands on its side)."""
    if not glob.glob(os.path.join(_JARS, "spark-connect_*.jar")):
        pytest.skip(
            f"pyspark {pyspark.__version__} ships no Spark Connect server jar (3.5's wheel "
            "has none); Connect is tested on the 4.x stacks"
        )
    return _connect_server.shared_server()[1]


@pytest.fixture(scope="module")
def connect_url(server_work):
    return _connect_server.shared_server()[0]  # the test process's (tests/_connect_server.py)


@pytest.fixture(scope="module")
def spark(connect_url):
    with _connect_server.remote_session(connect_url) as session:
        yield session


@pytest.fixture(scope="module")
def numbers(spark):
    """``x0..x3`` floats, ``features`` (``array<double>`` of them), ``y = x . WEIGHTS``."""
    rng = np.random.default_rng(5)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    frame = pd.DataFrame({f"x{i}": x[:, i].astype(np.float64) for i in range(4)})
    frame["y"] = (x @ WEIGHTS).astype(np.float64)
    df = spark.createDataFrame(frame)
    return df.withColumn("features", F.array(*[F.col(f"x{i}") for i in range(4)]))


def _regressor(store, **overrides):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    params = {
        "model": model,
        "optimizer": torch.optim.Adam(model.parameters(), lr=0.05),
        "loss": torch.nn.MSELoss(),
        "feature_cols": ["features"],
        "label_cols": ["y"],
        "batch_size": 16,
        "epochs": 2,
        "random_seed": 1,
        "reader": "arrow",
        "verbose": 0,
        "store": store,
    }
    params.update(overrides)
    return RingEstimator(**params)


@pytest.fixture(scope="module")
def fitted(spark, numbers, tmp_path_factory):
    """A RingModel fitted on Connect with ``num_proc`` unset: the server's 2 task slots."""
    store = str(tmp_path_factory.mktemp("connect-store"))
    return _regressor(store, validation=0.25, run_id="connect").fit(numbers), store


@pytest.fixture(scope="module")
def pipeline_fit(spark, numbers, tmp_path_factory):
    """``Pipeline([VectorAssembler, RingEstimator]).fit`` on Connect, in a thread of its
    own (as ``CrossValidator`` fits): the estimator makes the session active there."""
    store = str(tmp_path_factory.mktemp("connect-pipeline-store"))
    assembler = VectorAssembler(inputCols=[f"x{i}" for i in range(4)], outputCol="vector")
    estimator = _regressor(store, feature_cols=["vector"], num_proc=2, run_id="pipe", epochs=1)
    pipeline = Pipeline(stages=[assembler, estimator])
    out: dict = {}

    def fit():
        try:
            assert SparkSession.getActiveSession() is None  # a new thread has none
            out["model"] = pipeline.fit(numbers)
            out["active"] = SparkSession.getActiveSession()
        except BaseException as exc:  # re-raised on the test's thread
            out["error"] = exc

    worker = threading.Thread(target=fit)
    worker.start()
    worker.join(300)
    assert not worker.is_alive(), "the pipeline fit did not finish in 300 s"
    if "error" in out:
        raise out["error"]
    assert out["active"] is spark  # RingEstimator.fit made it the thread's active session
    return out["model"]


def _local_outputs(module, rows, column="features"):
    x = torch.tensor(np.array([list(r[column]) for r in rows]), dtype=torch.float32)
    with torch.no_grad():
        return module(x).numpy()[:, 0]


def _outputs(df, column="y__output"):
    return np.array([r[column] for r in df.orderBy("x0").select(column).collect()])


# --- fit and transform ---------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_fit_on_connect_trains_on_the_servers_slots_and_transform_predicts_as_the_model(
    spark, numbers, fitted
):
    assert spark_runner.is_connect(spark)
    assert spark_runner.default_num_proc(spark) == 2  # local[2], from spark.conf: no job
    model, store = fitted
    history = model.getHistory()
    assert [e["epoch"] for e in history] == [1, 2] and "val_loss" in history[-1]
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    train_dir = os.path.join(store, "intermediate_train_data.0")
    assert len([f for f in os.listdir(train_dir) if f.endswith(".parquet")]) == 2  # num_proc 2
    out = model.transform(numbers)
    assert out.columns == [*numbers.columns, "y__output"]
    rows = out.orderBy("x0").select("features", "y__output").collect()
    np.testing.assert_allclose(
        [r["y__output"] for r in rows], _local_outputs(model.getModel(), rows), rtol=1e-5
    )
    # trained: closer to y than the model it started from (_regressor's seed)
    y = np.array([r["y"] for r in numbers.orderBy("x0").select("y").collect()])
    start = _local_outputs(_regressor(None).getModel(), rows)
    assert np.mean((_outputs(out) - y) ** 2) < np.mean((start - y) ** 2)


@pytest.mark.timeout(240)
def test_fit_on_parquet_on_connect_trains_on_the_data_an_earlier_fit_wrote(spark, fitted):
    _, prefix = fitted
    store = Store.create(prefix)
    model = _regressor(prefix, run_id="from-parquet", epochs=1).fit_on_parquet(
        store.get_train_data_path(0), store.get_val_data_path(0)
    )
    assert [e["epoch"] for e in model.getHistory()] == [1] and "val_loss" in model.getHistory()[0]
    assert model.getFeatureShapes() == [[4]]


# --- persistence ---------------------------------------------------------------------------


@pytest.mark.timeout(180)
def test_a_ring_model_saves_and_loads_on_connect_and_overwrites(spark, numbers, fitted, tmp_path):
    original, _ = fitted
    path = str(tmp_path / "model")
    original.save(path)
    assert os.path.isdir(os.path.join(path, "metadata"))  # written by the server
    assert sorted(os.listdir(os.path.join(path, "model"))) == ["module.pkl", "weights.pt"]
    with pytest.raises(Exception, match="already exists"):
        original.save(path)
    original.write().overwrite().save(path)
    loaded = RingModel.load(path)
    assert loaded.uid == original.uid
    for name in ("history", "run_id", "feature_cols", "label_cols", "feature_shapes"):
        assert loaded.getOrDefault(name) == original.getOrDefault(name), name
    for key, value in original.getModel().state_dict().items():
        assert torch.equal(loaded.getModel().state_dict()[key], value)
    sample = numbers.limit(20)
    np.testing.assert_allclose(
        _outputs(loaded.transform(sample)), _outputs(original.transform(sample))
    )


@pytest.mark.timeout(300)
def test_a_fitted_pipeline_on_connect_saves_loads_and_transforms_the_same(
    spark, numbers, pipeline_fit, tmp_path
):
    ring = pipeline_fit.stages[-1]
    assert isinstance(ring, RingModel) and len(ring.getHistory()) == 1
    expected = _outputs(pipeline_fit.transform(numbers))
    rows = pipeline_fit.transform(numbers).orderBy("x0").select("vector").collect()
    np.testing.assert_allclose(expected, _local_outputs(ring.getModel(), rows, "vector"), rtol=1e-5)
    path = str(tmp_path / "pipeline")
    pipeline_fit.save(path)
    pipeline_fit.write().overwrite().save(path)
    loaded = PipelineModel.load(path)
    again = loaded.stages[-1]
    assert isinstance(again, RingModel) and again.uid == ring.uid
    assert again.getHistory() == ring.getHistory()
    np.testing.assert_allclose(_outputs(loaded.transform(numbers)), expected)


# --- refused on Connect, before any job / before anything is written ----------------------


@pytest.mark.timeout(60)
def test_num_proc_beyond_the_servers_slots_is_refused_before_the_data_is_written(
    spark, numbers, tmp_path
):
    store = tmp_path / "store"
    with pytest.raises(spark_runner.NotEnoughSlotsError) as info:
        _regressor(str(store), num_proc=3).fit(numbers)
    message = str(info.value)
    assert "needs 3 task slots" in message and "Spark Connect server's cluster has 2" in message
    assert "Lower num_proc to 2" in message
    written = os.listdir(store) if store.exists() else []
    assert not [p for p in written if p.startswith("intermediate_")]


@pytest.mark.timeout(60)
def test_a_store_the_server_cannot_see_is_refused_before_the_data_is_written(
    spark, numbers, tmp_path, monkeypatch
):
    """As a store on this client's disk looks to a remote server: the server is pointed
    at a place where the client's files are not."""
    store = Store.create(str(tmp_path / "store"))
    monkeypatch.setattr(type(store), "url", lambda self, path: "file:///no-such-ringtrain" + path)
    with pytest.raises(ValueError, match="Spark Connect server cannot see the store") as info:
        _regressor(store, num_proc=2).fit(numbers)
    message = str(info.value)
    assert "file:///no-such-ringtrain" in message and "setStore" in message
    assert os.listdir(store.prefix_path) == []  # no data, no probe left behind


@pytest.mark.timeout(120)
def test_a_path_the_server_and_the_client_see_apart_is_refused_naming_the_fix(
    spark, fitted, server_work, tmp_path, monkeypatch
):
    """A relative path is the server's working directory there and this client's here:
    the two halves of a save would land apart, so save and load say so."""
    model, _ = fitted
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError, match="both reach") as info:
        model.save("apart")
    assert "'apart' is relative" in str(info.value) and "absolute path" in str(info.value)
    assert os.path.isdir(server_work / "apart" / "metadata")  # the server's half
    assert not os.path.exists(tmp_path / "apart")  # no weights written on this side
    with pytest.raises(FileNotFoundError, match="finds no apart/model"):
        RingModel.load("apart")


@pytest.mark.timeout(60)
def test_persistence_on_connect_with_pyspark_before_4_is_refused_before_writing(
    spark, fitted, tmp_path, monkeypatch
):
    model, _ = fitted
    monkeypatch.setattr(pyspark, "__version__", "3.5.0")
    path = tmp_path / "old"
    for call in (lambda: model.save(str(path)), lambda: model.write().overwrite().save(str(path))):
        with pytest.raises(RuntimeError, match=r"needs pyspark 4\.0 or newer") as info:
            call()
        assert "from a classic SparkSession" in str(info.value)
    with pytest.raises(RuntimeError, match="RingModel load on a Spark Connect session"):
        RingModel.load(str(path))
    assert not path.exists()
