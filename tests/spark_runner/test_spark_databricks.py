"""On Databricks (DATABRICKS_RUNTIME_VERSION set) spark_runner picks other defaults:
the notebook's session, a longer start timeout, a log server on every address."""

from __future__ import annotations

import _spark
import pytest

import spark_runner
from ringcore import RingError
from spark_runner._platform import DATABRICKS_START_TIMEOUT_S, defaults
from spark_runner._run import resolve_timeout

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)


def test_databricks_runtime_picks_its_defaults(monkeypatch):
    monkeypatch.delenv(spark_runner.START_TIMEOUT_ENV_VAR, raising=False)
    monkeypatch.delenv("DATABRICKS_RUNTIME_VERSION", raising=False)
    plain = defaults()
    assert plain.platform == "Spark" and not plain.use_active_session
    assert resolve_timeout(None) == spark_runner.DEFAULT_START_TIMEOUT_S == 600

    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    chosen = defaults()
    assert chosen.platform == "Databricks Runtime 15.4"
    assert chosen.use_active_session and chosen.log_bind_host == "0.0.0.0"
    assert resolve_timeout(None) == DATABRICKS_START_TIMEOUT_S == 900
    assert resolve_timeout(5) == 5  # an explicit value still wins
    monkeypatch.setenv(spark_runner.START_TIMEOUT_ENV_VAR, "42")
    assert resolve_timeout(None) == 42  # and so does the variable


def test_local_session_on_databricks_uses_the_notebooks_session_never_a_new_one(monkeypatch):
    from pyspark.sql import SparkSession

    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "15.4")
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: None))
    with pytest.raises(RingError, match=r"Databricks Runtime 15.4: no active SparkSession"):
        spark_runner.local_session("local[2]")
    notebook_session = object()
    monkeypatch.setattr(SparkSession, "getActiveSession", classmethod(lambda cls: notebook_session))
    assert spark_runner.local_session("local[2]") is notebook_session


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_fit_without_a_store_on_databricks_goes_to_the_volume_or_is_refused_first(
    monkeypatch, tmp_path
):
    import torch

    from estimators import RingEstimator

    # a real local session, made before the marker is set (Databricks would give one)
    spark = _spark.shared_session()  # not stopped here: see tests/_spark.py
    rows = [([float(i % 3), float(i % 5)], i % 2) for i in range(64)]
    df = spark.createDataFrame(rows, ["x", "y"])
    volumes = tmp_path / "Volumes"
    monkeypatch.setenv("DATABRICKS_RUNTIME_VERSION", "17.3")
    monkeypatch.setenv("RING_VOLUMES_ROOT", str(volumes))
    monkeypatch.delenv("RING_DATABRICKS_VOLUME", raising=False)
    model = torch.nn.Linear(2, 2)
    estimator = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=8,
        epochs=1,
        num_proc=2,
        reader="arrow",
        verbose=0,
        run_id="volume_run",
    )
    with pytest.raises(ValueError, match=r"has no store and the default /Volumes/main/defa"):
        estimator.fit(df)
    assert not volumes.exists()  # refused before anything was written
    volume = volumes / "main" / "default" / "ringtrain"
    volume.mkdir(parents=True)
    fitted = estimator.fit(df)
    assert [e["epoch"] for e in fitted.getHistory()] == [1]
    (store,) = list(volume.iterdir())  # one new folder in the volume for the fit
    assert store.name.startswith("store-")
    assert (store / "runs" / "volume_run" / "checkpoint" / "checkpoint.pt").is_file()
