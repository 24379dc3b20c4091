"""RingEstimator with a Keras model on real Spark (local[2]): trains on the digits
across 2 ranks, saves, loads and transforms in Arrow batches."""

from __future__ import annotations

import os

import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import spark_runner
from estimators import RingEstimator, RingModel, Store, demo

EPOCHS = 4


@pytest.fixture(scope="module")
def spark(request):
    session = spark_runner.local_session(
        "local[2]", app_name="test-keras-estimator", conf={"spark.sql.shuffle.partitions": "2"}
    )
    session.sparkContext.setLogLevel("ERROR")
    request.addfinalizer(session.stop)
    return session


def _keras_model():
    import keras

    keras.utils.set_random_seed(demo.SEED)
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    import keras

    train_df, test_df = demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)
    store = Store.create(str(tmp_path_factory.mktemp("store")))
    estimator = RingEstimator(
        model=_keras_model(),
        optimizer=keras.optimizers.Adam(3e-3),
        loss=_loss(),
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=EPOCHS,
        num_proc=2,
        validation=0.1,
        store=store,
        run_id="keras-digits",
        reader="arrow",
        verbose=0,
        callbacks=[keras.callbacks.CSVLogger(str(store.prefix_path) + "/epochs.csv")],
    )
    return estimator.fit(train_df), store, test_df


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_keras_estimator_learns_the_digits_on_two_ranks(fitted):
    model, store, test_df = fitted
    accuracy = demo.held_out_accuracy(model, test_df)
    assert accuracy >= 0.85, model.getHistory()
    history = model.getHistory()
    assert [e["epoch"] for e in history] == list(range(1, EPOCHS + 1))
    for entry in history:
        assert {"train_loss", "train_accuracy", "val_loss", "val_accuracy", "seconds"} <= set(entry)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert store.exists(store.get_checkpoint_path("keras-digits"))
    assert store.read_json(store.get_history_path("keras-digits")) == history
    with open(str(store.prefix_path) + "/epochs.csv") as f:  # the user's Keras callback ran
        header = f.readline()  # (both ranks write this file; its header is the same)
    assert header.startswith("epoch,") and "val_accuracy" in header


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_keras_ring_model_saves_loads_and_transforms_alike(fitted, tmp_path):
    model, _, test_df = fitted
    path = str(tmp_path / "ring-model")
    model.save(path)
    loaded = RingModel.load(path)
    assert loaded.getHistory() == model.getHistory()
    before = model.transform(test_df).select("label__output").collect()
    after = loaded.transform(test_df).select("label__output").collect()
    np.testing.assert_allclose(
        [r["label__output"] for r in after], [r["label__output"] for r in before], rtol=1e-5
    )
    assert len(before) == test_df.count() and len(before[0]["label__output"]) == 10


@pytest.mark.spark
@pytest.mark.timeout(120)
def test_a_compiled_keras_model_brings_its_optimizer_loss_and_metrics(spark, tmp_path):
    import keras

    from estimators._config import resolve_config
    from estimators._train_keras import keras_worker

    df = demo.digits_frame(spark).limit(40)
    compiled = _keras_model()
    compiled.compile(optimizer=keras.optimizers.SGD(0.05), loss=_loss(), metrics=["accuracy"])
    est = RingEstimator(
        model=compiled,
        feature_cols=["features"],
        label_cols=["label"],
        num_proc=2,
        store=Store.create(str(tmp_path)),
    )
    cfg = resolve_config(est, df)

    class Data:
        train_path, val_path, steps_per_epoch = "unused", None, 1

    _, (spec,) = keras_worker(cfg, Data())
    import cloudpickle

    optimizer, loss, metrics = cloudpickle.loads(spec.compile_objects)
    assert optimizer["class_name"] == "SGD"
    assert optimizer["config"]["learning_rate"] == pytest.approx(0.05)
    assert "SparseCategoricalCrossentropy" in str(loss)
    assert metrics == ["accuracy"]
    bare = RingEstimator(model=_keras_model(), feature_cols=["features"], label_cols=["label"])
    with pytest.raises(ValueError, match="no optimizer"):
        resolve_config(bare, df)
