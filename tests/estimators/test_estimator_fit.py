"""estimators: RingEstimator / RingModel on real Spark (local[2]), petastorm and Gloo."""

from __future__ import annotations

import json
import os

import _spark
import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _digits import demo
from pyspark.sql.types import ArrayType, DoubleType

from estimators import RingEstimator, RingModel, Store
from estimators._params import ESTIMATOR_PARAMS, MODEL_PARAMS, accessor_names
from estimators.frameworks.torch._loop import train
from estimators.frameworks.torch._spec import TorchSpec
from estimators.frameworks.torch._tensors import as_target
from ringcore.testing import run_workers

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

EPOCHS = 4


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


@pytest.fixture(scope="module")
def digits(spark):
    train_df, test_df = demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)
    return train_df, test_df


@pytest.fixture(scope="module")
def fitted(digits, tmp_path_factory):
    store = Store.create(str(tmp_path_factory.mktemp("store")))
    estimator = demo.make_estimator(store, epochs=EPOCHS)
    estimator.setRunId("digits")
    return estimator.fit(digits[0]), store


def _estimator(**overrides):
    model = torch.nn.Linear(64, 10)
    params = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "loss": torch.nn.CrossEntropyLoss(),
        "feature_cols": ["features"],
        "label_cols": ["label"],
    }
    params.update(overrides)
    return RingEstimator(**params)


# --- fit and transform on the digits ------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
def test_fit_then_transform_classifies_held_out_digits(fitted, digits):
    model, _ = fitted
    accuracy = demo.held_out_accuracy(model, digits[1])
    assert accuracy >= 0.85, model.getHistory()


@pytest.mark.spark
def test_history_has_one_entry_per_epoch_and_matches_the_store(fitted):
    model, store = fitted
    history = model.getHistory()
    assert [entry["epoch"] for entry in history] == list(range(1, EPOCHS + 1))
    for entry in history:
        assert {"train_loss", "train_accuracy", "val_loss", "val_accuracy"} <= set(entry)
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert model.getRunId() == "digits"
    with open(store.get_history_path("digits")) as f:
        assert json.load(f) == history
    assert os.path.isfile(store.get_checkpoint_path("digits"))
    assert os.path.isdir(store.get_train_data_path(0)) and os.path.isdir(store.get_val_data_path(0))


@pytest.mark.spark
def test_fit_writes_one_parquet_file_per_process(fitted):
    _, store = fitted
    for path in (store.get_train_data_path(0), store.get_val_data_path(0)):
        files = sorted(f for f in os.listdir(path) if f.endswith(".parquet"))
        assert len(files) == 2
        assert all(pq.ParquetFile(os.path.join(path, f)).num_row_groups == 1 for f in files)


@pytest.mark.spark
def test_transform_keeps_the_columns_and_appends_logits(fitted, digits):
    model, _ = fitted
    out = model.transform(digits[1])
    assert out.columns == [*digits[1].columns, "label__output"]
    assert out.schema["label__output"].dataType == ArrayType(DoubleType(), False)
    first = out.select("label__output").first()[0]
    assert len(first) == 10
    assert isinstance(model.getModel(), torch.nn.Module)


@pytest.mark.spark
def test_a_model_with_one_output_value_appends_a_double_column(spark, digits):
    head = torch.nn.Linear(64, 1)
    model = RingModel(
        model=head,
        feature_cols=["features"],
        label_cols=["label"],
        output_cols=["score"],
        feature_shapes=[[64]],
    )
    out = model.transform(digits[1].limit(7))
    assert out.schema["score"].dataType == DoubleType()
    rows = out.select("features", "score").collect()
    expected = head(
        torch.from_numpy(np.stack([r["features"].toArray() for r in rows]).astype(np.float32))
    )
    np.testing.assert_allclose(
        [r["score"] for r in rows], expected.detach().numpy()[:, 0], rtol=1e-5
    )


# --- errors before any job -----------------------------------------------------------------


@pytest.mark.spark
def test_missing_feature_column_is_refused_before_any_spark_job(spark, digits, tmp_path):
    sc = spark.sparkContext
    group = "test-missing-feature-column"
    sc.setJobGroup(group, "must stay empty")
    try:
        estimator = _estimator(feature_cols=["pixels"], store=str(tmp_path))
        with pytest.raises(ValueError) as info:
            estimator.fit(digits[0])
        assert sc.statusTracker().getJobIdsForGroup(group) == []
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    message = str(info.value)
    assert "feature column 'pixels' is not in the DataFrame" in message
    assert "its columns are: features, label" in message
    assert "setFeatureCols" in message
    assert os.listdir(tmp_path) == []


@pytest.mark.spark
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"batch_size": 0}, "batch_size must be a positive integer, got 0"),
        ({"epochs": -1}, "epochs must be a positive integer"),
        ({"num_proc": 0}, "num_proc must be a positive integer"),
        ({"validation": 1.0}, r"validation is the fraction of rows held out, in \[0, 1\); got 1.0"),
        ({"reader": "csv"}, "reader must be one of"),
        ({"label_cols": ["nope"]}, "label column 'nope' is not in the DataFrame"),
        ({"model": "not a module"}, "model must be a torch.nn.Module"),
        ({"loss": 3}, "loss must be callable"),
        ({"metrics": ["f1"]}, "unknown metric 'f1'"),
        ({"feature_cols": ["label"]}, "in both feature_cols and label_cols"),
    ],
)
def test_bad_params_are_refused_with_the_fix(digits, overrides, message):
    with pytest.raises(ValueError, match=message):
        _estimator(**overrides).fit(digits[0])


@pytest.mark.spark
def test_a_string_feature_column_is_refused_naming_its_type(spark):
    df = spark.createDataFrame([("a", 1)], ["text", "label"])
    with pytest.raises(ValueError, match="feature column 'text' has type string"):
        _estimator(feature_cols=["text"]).fit(df)


def test_an_optimizer_of_another_model_is_refused(spark):
    other = torch.nn.Linear(2, 2)
    df = spark.createDataFrame([(1.0, 1)], ["x", "label"])
    with pytest.raises(ValueError, match="not in the model"):
        _estimator(optimizer=torch.optim.SGD(other.parameters(), lr=0.1), feature_cols=["x"]).fit(
            df
        )


# --- params ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "specs"), [(RingEstimator, ESTIMATOR_PARAMS), (RingModel, MODEL_PARAMS)]
)
def test_every_param_has_a_generated_getter_setter_and_default(cls, specs):
    instance = cls()
    for spec in specs:
        get_name, set_name = accessor_names(spec)
        assert callable(getattr(instance, set_name))
        assert getattr(instance, get_name)() == spec.default, spec.name
        assert instance.hasDefault(spec.name) and not instance.isSet(spec.name)
        assert spec.doc in instance.explainParam(spec.name)
    assert {p.name for p in instance.params} == {s.name for s in specs}


def test_setters_convert_and_chain():
    estimator = RingEstimator(batch_size=8)
    assert estimator.setEpochs(3).setFeatureCols("features") is estimator
    assert (estimator.getBatchSize(), estimator.getEpochs(), estimator.getFeatureCols()) == (
        8,
        3,
        ["features"],
    )
    assert isinstance(estimator.setStore("/tmp/somewhere").getStore(), Store)
    copied = estimator.copy({estimator.epochs: 5})
    assert (copied.getEpochs(), estimator.getEpochs()) == (5, 3)


def test_unknown_constructor_params_name_the_known_ones():
    with pytest.raises(TypeError, match=r"unknown param.*epoch_count.*its params are:.*batch_size"):
        RingEstimator(epoch_count=3)


# --- the store ---------------------------------------------------------------------------------


def test_store_layout_follows_horovod(tmp_path):
    store = Store.create("file://" + str(tmp_path))
    assert store.get_train_data_path(2) == str(tmp_path / "intermediate_train_data.2")
    assert store.get_val_data_path(0) == str(tmp_path / "intermediate_val_data.0")
    assert store.get_checkpoint_path("r") == str(
        tmp_path / "runs" / "r" / "checkpoint" / "checkpoint.pt"
    )
    assert store.next_data_index() == 0
    os.makedirs(store.get_train_data_path(0))
    assert store.next_data_index() == 1
    store.write_json(store.get_history_path("r"), [{"epoch": 1}])
    assert store.read_json(store.get_history_path("r")) == [{"epoch": 1}]
    assert os.listdir(store.get_logs_path("r")) == ["history.json"]  # no temporary file left


# --- the worker loop without Spark ------------------------------------------------------------


def _tiny_dataset(path, sizes):
    rng = np.random.default_rng(0)
    os.makedirs(path)
    for i, n in enumerate(sizes):
        x = rng.normal(size=(n, 4)).astype(np.float32)
        y = (x.sum(axis=1) > 0).astype(np.int64)
        table = pa.table({"x": pa.array(list(x), type=pa.list_(pa.float32())), "y": pa.array(y)})
        pq.write_table(table, os.path.join(path, f"part-{i}.parquet"), row_group_size=32)


def _tiny_spec(store, epochs):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.5)
    return TorchSpec(
        user_objects=cloudpickle.dumps(
            (model, type(optimizer), torch.nn.CrossEntropyLoss(), ["accuracy"], [])
        ),
        optimizer_groups=[[0, 1]],
        optimizer_state=optimizer.state_dict(),
        feature_cols=["x"],
        label_cols=["y"],
        train_path=store.get_train_data_path(0),
        val_path=store.get_val_data_path(0),
        batch_size=16,
        val_batch_size=50,
        epochs=epochs,
        steps_per_epoch=5,
        val_steps=None,
        shuffle=True,
        seed=1,
        reader="arrow",
        reader_workers=1,
        backward_passes_per_step=1,
        store=store,
        run_id="tiny",
    )


@pytest.mark.slow
def test_worker_loop_trains_on_ragged_files_and_resumes_from_its_checkpoint(tmp_path):
    store = Store.create(str(tmp_path))
    _tiny_dataset(store.get_train_data_path(0), [70, 20, 110])  # uneven: the arrow reader evens it
    _tiny_dataset(store.get_val_data_path(0), [41])

    def fit_then_resume(two_epochs, three_epochs):  # one spawn of the ranks for both runs
        return train(two_epochs), train(three_epochs)

    specs = (_tiny_spec(store, epochs=2), _tiny_spec(store, epochs=3))
    (first, resumed), (other, _) = run_workers(fit_then_resume, np=2, args=specs)
    assert other is None
    assert [e["epoch"] for e in first] == [1, 2]
    assert resumed[:2] == first and resumed[2]["epoch"] == 3
    assert resumed[2]["val_accuracy"] > 0.8
    checkpoint = torch.load(store.get_checkpoint_path("tiny"), weights_only=True)
    assert checkpoint["epoch"] == 3 and checkpoint["history"] == resumed
    assert set(checkpoint["model"]) == {"weight", "bias"}


def test_spark_ml_double_labels_become_class_indices_and_scalars_meet_one_output():
    class_labels = as_target(torch.zeros(3, 4), torch.tensor([1.0, 3.0, 0.0]))
    assert class_labels.dtype == torch.long and class_labels.tolist() == [1, 3, 0]
    column = as_target(torch.zeros(3, 1), torch.tensor([1, 0, 1]))
    assert column.shape == (3, 1) and column.dtype == torch.float32
    assert as_target(torch.zeros(3, 4), torch.tensor([2, 1, 0])).dtype == torch.int64
