"""TensorBoard event files and live MLflow logging of RingEstimator fits (real Spark
local[2], real Gloo, a real local MLflow file store)."""

from __future__ import annotations

import time

import _spark
import pytest
import torch
from _digits import demo

from estimators import Callback, RingEstimator, Store, read_tensorboard_scalars
from ringcore.runs import ScalarWriter, read_scalars

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

EPOCHS = 3


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


@pytest.fixture(scope="module")
def digits(spark):
    return demo.digits_frame(spark).limit(640).cache()


@pytest.fixture
def mlflow_uri(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    previous = mlflow.get_tracking_uri()
    uri = "file://" + str(tmp_path / "mlruns")
    mlflow.set_tracking_uri(uri)
    yield uri
    while mlflow.active_run() is not None:
        mlflow.end_run()
    mlflow.set_tracking_uri(previous)


def _wait_for_driver_epoch(uri: str, run_id: str, flag: str, last_epoch: int) -> Callback:
    """Rank 0, at the end of the last epoch: wait until the driver has logged epoch 1 to
    the MLflow run, and record whether it had (proves the logging is live). Defined in a
    function, so cloudpickle ships the class by value to the workers."""

    class WaitForDriverEpoch(Callback):
        def on_epoch_end(self, epoch, logs):
            if self.rank != 0 or epoch != last_epoch:
                return
            import os

            from mlflow.tracking import MlflowClient

            os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"  # Spark restores the worker's env
            client = MlflowClient(tracking_uri=uri)
            seen = False
            for _ in range(600):  # the driver polls the history every 0.3 s
                if any(m.step == 1 for m in client.get_metric_history(run_id, "train_loss")):
                    seen = True
                    break
                time.sleep(0.1)
            with open(flag, "w") as f:
                f.write("seen" if seen else "not seen")

    return WaitForDriverEpoch()


def _estimator(store, run_id, **overrides):
    torch.manual_seed(demo.SEED)
    model = torch.nn.Linear(64, 10)
    params = dict(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=EPOCHS,
        num_proc=2,
        validation=0.2,
        store=store,
        run_id=run_id,
        random_seed=demo.SEED,
        inmemory_cache_all=True,
        progress=False,
    )
    params.update(overrides)
    return RingEstimator(**params)


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_fit_logs_params_each_epoch_live_and_the_model_to_the_active_mlflow_run(
    digits, tmp_path, mlflow_uri
):
    import mlflow
    import mlflow.pytorch
    from mlflow.tracking import MlflowClient

    store = Store.create(str(tmp_path / "store"))
    flag = tmp_path / "seen.txt"
    with mlflow.start_run() as run:
        callback = _wait_for_driver_epoch(mlflow_uri, run.info.run_id, str(flag), EPOCHS - 1)
        fitted = _estimator(store, "tracked", callbacks=[callback]).fit(digits)
    client = MlflowClient()
    finished = client.get_run(run.info.run_id)
    losses = client.get_metric_history(run.info.run_id, "train_loss")
    history = fitted.getHistory()

    assert flag.read_text() == "seen"  # epoch 1 reached MLflow while the last one still ran
    assert finished.info.status == "FINISHED"
    assert finished.data.params["ringtrain.epochs"] == str(EPOCHS)
    assert finished.data.params["ringtrain.run_id"] == "tracked"
    assert sorted(m.step for m in losses) == list(range(1, EPOCHS + 1))  # each epoch once
    assert {m.step: m.value for m in losses} == pytest.approx(
        {e["epoch"]: e["train_loss"] for e in history}
    )
    assert {"val_loss", "val_accuracy"} <= set(finished.data.metrics)
    models = mlflow.search_logged_models(
        experiment_ids=[run.info.experiment_id], output_format="list"
    )
    assert [m.source_run_id for m in models] == [run.info.run_id]
    logged = mlflow.pytorch.load_model(models[0].model_uri)
    x = torch.rand(3, 64)
    torch.testing.assert_close(logged(x), fitted.getModel()(x))

    # the same fit wrote TensorBoard scalars: every step of rank 0, every epoch's metrics
    scalars = read_tensorboard_scalars(store, "tracked")
    steps = [s for s, _ in scalars["step/loss"]]
    assert len(steps) % EPOCHS == 0 and steps == list(range(1, len(steps) + 1))
    assert [s for s, _ in scalars["epoch/train_loss"]] == list(range(1, EPOCHS + 1))
    assert [v for _, v in scalars["epoch/val_accuracy"]] == pytest.approx(
        [e["val_accuracy"] for e in history]
    )


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_failed_fit_ends_the_active_mlflow_run_as_failed(digits, tmp_path, mlflow_uri):
    import mlflow
    from mlflow.tracking import MlflowClient

    class Broken(Callback):  # local: cloudpickle ships it by value
        def on_epoch_end(self, epoch, logs):
            raise ValueError("broken callback")

    store = Store.create(str(tmp_path / "store"))
    with mlflow.start_run() as run:
        with pytest.raises(Exception, match="broken callback"):
            _estimator(store, "failing", epochs=1, callbacks=[Broken()]).fit(digits)
        assert mlflow.active_run() is None  # the fit ended the run it logged to
    failed = MlflowClient().get_run(run.info.run_id)
    assert failed.info.status == "FAILED"
    assert failed.data.params["ringtrain.run_id"] == "failing"


def test_scalar_writer_round_trips_through_the_event_file_reader(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    writer = ScalarWriter(store, "tb")
    assert writer.enabled
    for step in range(1, 6):
        writer.add("step/loss", 1.0 / step, step)
    writer.add_epoch({"epoch": 1, "train_loss": 0.5, "lr": 0.1, "seconds": 2.0, "stop": True})
    writer.close()
    scalars = read_scalars(store.get_logs_path("tb"))
    assert [s for s, _ in scalars["step/loss"]] == [1, 2, 3, 4, 5]
    assert [v for _, v in scalars["step/loss"]] == pytest.approx([1.0 / s for s in range(1, 6)])
    assert scalars["epoch/train_loss"] == [(1, 0.5)]
    assert [v for _, v in scalars["epoch/lr"]] == pytest.approx([0.1])
    assert "epoch/seconds" not in scalars and "epoch/stop" not in scalars


def test_reading_a_folder_without_event_files_names_it_and_the_fix(tmp_path):
    with pytest.raises(
        FileNotFoundError, match=r"no TensorBoard event file.*ringtrain\[tensorboard\]"
    ):
        read_scalars(str(tmp_path))
