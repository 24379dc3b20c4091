"""RingEstimator with a Keras model on real Spark (local[2]): trains on the digits
across 2 ranks, saves, loads and transforms in Arrow batches. The fit's model holds a
custom layer only loadable through custom_objects, and a checkpoint_callback picks the
model fit returns. A run_id fitted again on 2 ranks resumes at the next epoch and ends at
the model of an uninterrupted fit."""

from __future__ import annotations

import os

import _spark
import numpy as np
import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from _digits import demo

from estimators import RingEstimator, RingModel, Store, read_tensorboard_scalars

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

EPOCHS = 4


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


def _keras_model():
    import keras

    keras.utils.set_random_seed(demo.SEED)
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )


def _custom_objects():
    """A layer class made in a function: Keras finds it only through custom_objects."""
    import keras

    class Halve(keras.layers.Layer):
        def call(self, x):
            return x * 0.5

    return {"Halve": Halve}


def _custom_model(objects):
    import keras

    keras.utils.set_random_seed(demo.SEED)
    return keras.Sequential(
        [
            keras.Input((64,)),
            keras.layers.Dense(64, activation="relu"),
            objects["Halve"](),
            keras.layers.Dense(10),
        ]
    )


def _loss():
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture(scope="module")
def fitted(spark, tmp_path_factory):
    import keras

    train_df, test_df = demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)
    store = Store.create(str(tmp_path_factory.mktemp("store")))
    objects = _custom_objects()
    estimator = RingEstimator(
        model=_custom_model(objects),
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
        custom_objects=objects,
        tensorflow_dataset_prefetch_buffer_size=2,
        checkpoint_callback=keras.callbacks.ModelCheckpoint(
            "ignored.keras", monitor="val_accuracy", mode="max", save_best_only=True
        ),
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
    # rank 0's Keras progress callback: the progress file and the TensorBoard scalars
    progress = store.read_json(store.get_logs_path("keras-digits") + "/progress.json")
    assert (progress["epoch"], progress["step"]) == (EPOCHS, progress["steps"])
    scalars = read_tensorboard_scalars(store, "keras-digits")
    assert len(scalars["step/loss"]) == EPOCHS * progress["steps"]
    assert [step for step, _ in scalars["epoch/val_accuracy"]] == list(range(1, EPOCHS + 1))


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_checkpoint_callback_picks_the_model_fit_returns_and_custom_objects_load_it(fitted):
    from estimators.frameworks.keras._model_io import model_from_bytes, model_to_bytes

    model, store, _ = fitted
    history = model.getHistory()
    trained = model.getModel()
    best = store.get_run_path("keras-digits") + "/best.keras"
    assert store.exists(best)  # rank 0's ModelCheckpoint, its filepath set to the run's file
    objects = _custom_objects()
    kept = model_from_bytes(store.read_bytes(best), custom_objects=objects)
    last = model_from_bytes(
        store.read_bytes(store.get_checkpoint_path("keras-digits")), custom_objects=objects
    )
    for mine, theirs in zip(trained.get_weights(), kept.get_weights(), strict=True):
        np.testing.assert_array_equal(mine, theirs)  # fit returns what the callback saved
    # save_best_only on val_accuracy (max): the first epoch with the highest one
    best_epoch = int(np.argmax([e["val_accuracy"] for e in history]))
    same_as_last = all(
        np.array_equal(a, b) for a, b in zip(trained.get_weights(), last.get_weights())
    )
    assert same_as_last == (best_epoch == EPOCHS - 1), (best_epoch, history)
    with pytest.raises(Exception, match="Halve"):  # the layer needs custom_objects
        model_from_bytes(model_to_bytes(trained))


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

    from estimators.fit._resolve import resolve_config
    from estimators.frameworks.keras._spec import keras_spec

    df = demo.digits_frame(spark).limit(40)
    compiled = _keras_model()
    compiled.compile(optimizer=keras.optimizers.SGD(0.05), loss=_loss(), metrics=["accuracy"])
    est = RingEstimator(
        model=compiled,
        feature_cols=["features"],
        label_cols=["label"],
        num_proc=2,
        store=Store.create(str(tmp_path)),
        tensorflow_dataset_prefetch_buffer_size=3,
    )
    cfg = resolve_config(est, df)

    class Data:
        train_path, val_path, steps_per_epoch = "unused", None, 1

    spec = keras_spec(cfg, Data())
    import cloudpickle

    optimizer, loss, metrics = cloudpickle.loads(spec.compile_objects)
    assert optimizer["class_name"] == "SGD"
    assert optimizer["config"]["learning_rate"] == pytest.approx(0.05)
    assert "SparseCategoricalCrossentropy" in str(loss)
    assert metrics == ["accuracy"]
    assert spec.prefetch == 3 and cloudpickle.loads(spec.custom_objects) == {}
    assert spec.checkpoint_callback == b""
    with pytest.raises(ValueError, match=r"checkpoint_callback takes a keras.*ModelCheckpoint"):
        resolve_config(est.setCheckpointCallback(object()), df)  # before any job
    bare = RingEstimator(model=_keras_model(), feature_cols=["features"], label_cols=["label"])
    with pytest.raises(ValueError, match="no optimizer"):
        resolve_config(bare, df)


# the old deadlock (rank 0 broadcast its restored optimizer's variables alone) fails in
# seconds with these instead of the launch's 600 s
_FAST_STALL = {"RING_STALL_CHECK_TIME_SECONDS": "3", "RING_STALL_SHUTDOWN_TIME_SECONDS": "15"}


def _resumable(store, run_id, epochs):
    """Adam (state that a resume must restore), no shuffle: two epochs of this fit give
    the same model whether or not a resume sits between them."""
    import keras

    return RingEstimator(
        model=_keras_model(),
        optimizer=keras.optimizers.Adam(1e-2),
        loss=_loss(),
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=8,
        epochs=epochs,
        num_proc=2,
        shuffle=False,
        random_seed=demo.SEED,
        store=store,
        run_id=run_id,
        reader="arrow",
        verbose=0,
        backend_env=_FAST_STALL,
    )


@pytest.mark.spark
@pytest.mark.timeout(240)
def test_a_keras_fit_resumed_on_two_ranks_goes_on_at_epoch_2_to_the_uninterrupted_model(
    spark, tmp_path
):
    df = demo.digits_frame(spark).limit(32)  # 16 rows a rank: 2 steps an epoch
    store = Store.create(str(tmp_path))
    first = _resumable(store, "resumed", epochs=1).fit(df).getHistory()
    resumed = _resumable(store, "resumed", epochs=2).fit(df)
    straight = _resumable(store, "straight", epochs=2).fit(df)
    history = resumed.getHistory()
    assert [e["epoch"] for e in history] == [1, 2]
    assert history[0] == first[0]  # epoch 1 came from the checkpoint, not trained again
    assert history[1]["train_loss"] == pytest.approx(straight.getHistory()[1]["train_loss"])
    # rank 1 trained epoch 2 from rank 0's restored weights and Adam state too
    for mine, theirs in zip(
        resumed.getModel().get_weights(), straight.getModel().get_weights(), strict=True
    ):
        np.testing.assert_allclose(mine, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prefetch", [0, 3])
def test_the_workers_tf_data_pipeline_prefetches_the_knobs_batches(prefetch):
    from types import SimpleNamespace

    from estimators.frameworks.keras._data import dataset

    spec = SimpleNamespace(
        transformation_fn=None,
        feature_cols=["x"],
        label_cols=["y"],
        sample_weight_col=None,
        prefetch=prefetch,
    )
    batches = iter([{"x": np.ones((4, 2)), "y": np.zeros(4)}] * 3)
    pipeline = dataset(spec, batches)
    buffer = getattr(pipeline, "_buffer_size", None)  # tf.data's PrefetchDataset holds it
    assert (None if buffer is None else int(buffer)) == (prefetch or None)
    assert [x.shape for x, _ in pipeline.take(2)] == [(4, 2), (4, 2)]


@pytest.mark.parametrize(("steps", "batches"), [(None, [8, 8, 4]), (2, [8, 8])])
def test_keras_validation_is_a_dataset_streamed_from_the_store_each_evaluation(
    tmp_path, steps, batches
):
    """The validation shard reaches model.fit as a tf.data pipeline over the store
    (ValidationShard), read again for every evaluation: never arrays held whole."""
    from types import SimpleNamespace

    import pyarrow as pa
    import pyarrow.parquet as pq
    import tensorflow as tf

    from estimators.frameworks.keras._data import validation_dataset

    (tmp_path / "val").mkdir()
    x = np.arange(40, dtype=np.float32).reshape(20, 2)
    table = pa.table({"x": list(x), "y": np.arange(20, dtype=np.float32)})
    pq.write_table(table, tmp_path / "val" / "part-00000.parquet", row_group_size=6)
    spec = SimpleNamespace(
        store=Store.create(str(tmp_path / "store")), feature_cols=["x"], label_cols=["y"],
        sample_weight_col=None, transformation_fn=None, reader="arrow", val_batch_size=8,
        val_steps=steps, val_reader_workers=2, reader_pool="thread",
    )  # fmt: skip
    val = validation_dataset(spec, str(tmp_path / "val"), 0, 1)
    assert isinstance(val, tf.data.Dataset)
    for _ in range(2):  # two epochs' evaluations: the same rows, read afresh
        seen = [(xb.numpy(), yb.numpy()) for xb, yb in val]
        assert [len(yb) for _, yb in seen] == batches
        ys = np.concatenate([yb for _, yb in seen])
        assert ys.tolist() == list(range(sum(batches)))
        assert seen[0][0].shape == (8, 2)
