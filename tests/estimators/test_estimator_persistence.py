"""estimators: save/load, Pipeline, copy, CrossValidator, prepared-data reuse,
``fit_on_parquet`` and the data options, on real Spark (local[2]), petastorm and Gloo."""

from __future__ import annotations

import os

import _spark
import numpy as np
import pandas as pd
import pytest
import torch
from pyspark.ml import Pipeline, PipelineModel
from pyspark.ml.evaluation import RegressionEvaluator
from pyspark.ml.feature import VectorAssembler
from pyspark.ml.linalg import SparseVector, VectorUDT
from pyspark.ml.tuning import CrossValidator, ParamGridBuilder
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DoubleType,
    LongType,
    StructField,
    StructType,
)

from estimators import RingEstimator, RingModel, Store
from estimators.fit._cache import clear_cache
from estimators.frameworks.torch._losses import batch_loss

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

ROWS = 256
WEIGHTS = np.array([1.5, -2.0, 0.5, 1.0], dtype=np.float32)


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


@pytest.fixture(scope="module")
def numbers(spark):
    """``x0..x3`` floats, ``y = x . WEIGHTS`` (a linear regression), ``is_val`` every 4th row."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(ROWS, 4)).astype(np.float32)
    frame = pd.DataFrame({f"x{i}": x[:, i].astype(np.float64) for i in range(4)})
    frame["y"] = (x @ WEIGHTS).astype(np.float64)
    frame["is_val"] = (np.arange(ROWS) % 4 == 0).astype(np.int64)
    frame["w"] = np.where(np.arange(ROWS) % 2 == 0, 1.0, 0.5)
    return spark.createDataFrame(frame)


@pytest.fixture(scope="module")
def assembled(numbers):
    return VectorAssembler(inputCols=[f"x{i}" for i in range(4)], outputCol="features").transform(
        numbers
    )


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
        "num_proc": 2,
        "random_seed": 1,
        "verbose": 0,
        "store": store,
    }
    params.update(overrides)
    return RingEstimator(**params)


def _data_dirs(prefix):
    return sorted(d for d in os.listdir(prefix) if d.startswith("intermediate_"))


@pytest.fixture(scope="module")
def pipeline_fit(numbers, tmp_path_factory):
    """A fitted Pipeline([VectorAssembler, RingEstimator]) and its store."""
    prefix = str(tmp_path_factory.mktemp("pipeline-store"))
    clear_cache()
    assembler = VectorAssembler(inputCols=[f"x{i}" for i in range(4)], outputCol="features")
    estimator = _regressor(prefix, validation=0.25, run_id="pipe")
    return Pipeline(stages=[assembler, estimator]).fit(numbers), prefix


def _outputs(df, column="y__output"):
    return np.array([r[column] for r in df.orderBy("x0").select(column).collect()])


# --- persistence -------------------------------------------------------------------------


@pytest.mark.spark
def test_a_fitted_pipeline_saves_and_loads_and_transforms_the_same(pipeline_fit, numbers, tmp_path):
    fitted, _ = pipeline_fit
    path = str(tmp_path / "pipeline")
    fitted.save(path)
    loaded = PipelineModel.load(path)
    ring = loaded.stages[-1]
    assert isinstance(ring, RingModel) and ring.uid == fitted.stages[-1].uid
    assert ring.getHistory() == fitted.stages[-1].getHistory()
    np.testing.assert_allclose(
        _outputs(loaded.transform(numbers)), _outputs(fitted.transform(numbers))
    )


@pytest.mark.spark
def test_a_ring_model_saves_params_weights_and_structure_and_overwrites(
    pipeline_fit, assembled, tmp_path
):
    original = pipeline_fit[0].stages[-1]
    path = str(tmp_path / "model")
    original.save(path)
    assert sorted(os.listdir(os.path.join(path, "model"))) == ["module.pkl", "weights.pt"]
    with pytest.raises(Exception, match="already exists"):
        original.save(path)
    original.write().overwrite().save(path)
    loaded = RingModel.load(path)
    for name in (
        "history",
        "run_id",
        "feature_cols",
        "label_cols",
        "output_cols",
        "feature_shapes",
    ):
        assert loaded.getOrDefault(name) == original.getOrDefault(name), name
    assert loaded.getStore().prefix_path == original.getStore().prefix_path
    for key, value in original.getModel().state_dict().items():
        assert torch.equal(loaded.getModel().state_dict()[key], value)
    sample = assembled.limit(20)
    np.testing.assert_allclose(
        _outputs(loaded.transform(sample)), _outputs(original.transform(sample))
    )


class _WithBuffer(torch.nn.Module):
    """A module whose class lives in this test file, with a non-persistent buffer."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)
        self.register_buffer("offset", torch.tensor([2.5]), persistent=False)

    def forward(self, x):
        return self.linear(x) + self.offset


@pytest.mark.spark
def test_a_module_of_a_custom_class_with_a_non_persistent_buffer_round_trips(spark, tmp_path):
    module = _WithBuffer()
    model = RingModel(
        model=module, feature_cols=["features"], label_cols=["y"], feature_shapes=[[4]]
    )
    model.save(str(tmp_path / "m"))
    loaded = RingModel.load(str(tmp_path / "m")).getModel()
    x = torch.ones(3, 4)
    assert isinstance(loaded, _WithBuffer) and not loaded.training
    torch.testing.assert_close(loaded(x), module(x))


def test_copy_gives_an_independent_estimator_whose_optimizer_drives_its_own_model(tmp_path):
    estimator = _regressor(str(tmp_path), batch_size=32)
    copied = estimator.copy({estimator.batch_size: 8})
    assert (copied.getBatchSize(), estimator.getBatchSize()) == (8, 32)
    assert copied.getModel() is not estimator.getModel()
    copied_params = {id(p) for p in copied.getModel().parameters()}
    assert all(
        id(p) in copied_params for g in copied.getOptimizer().param_groups for p in g["params"]
    )
    with torch.no_grad():
        copied.getModel().weight.fill_(7.0)
    assert not torch.equal(estimator.getModel().weight, copied.getModel().weight)


# --- prepared data: reuse and fit_on_parquet --------------------------------------------


@pytest.mark.spark
def test_a_second_fit_of_the_same_data_reuses_the_parquet(assembled, tmp_path):
    prefix = str(tmp_path)
    first = _regressor(prefix, validation=0.25, epochs=1, run_id="first").fit(assembled)
    before = _data_dirs(prefix)
    assert before == ["intermediate_train_data.0", "intermediate_val_data.0"]
    again = _regressor(prefix, validation=0.25, epochs=1, batch_size=8, run_id="again")
    assert len(again.fit(assembled).getHistory()) == 1
    assert _data_dirs(prefix) == before  # no new intermediate dir
    assert len(first.getHistory()) == 1
    _regressor(prefix, validation=0.5, epochs=1, run_id="other").fit(assembled)
    assert len(_data_dirs(prefix)) == 4  # another split: new data


@pytest.mark.spark
def test_fit_on_parquet_trains_on_data_an_earlier_fit_wrote(pipeline_fit):
    _, prefix = pipeline_fit
    store = Store.create(prefix)
    model = _regressor(prefix, run_id="from-parquet", epochs=3).fit_on_parquet(
        store.get_train_data_path(0), store.get_val_data_path(0)
    )
    history = model.getHistory()
    assert [e["epoch"] for e in history] == [1, 2, 3] and "val_loss" in history[-1]
    assert model.getFeatureShapes() == [[4]]
    assert _data_dirs(prefix) == ["intermediate_train_data.0", "intermediate_val_data.0"]
    with pytest.raises(ValueError, match="has no column"):
        _regressor(prefix, label_cols=["nope"]).fit_on_parquet(store.get_train_data_path(0))


# --- data: vectors, validation column, weights, transformation_fn --------------------------


@pytest.mark.spark
def test_sparse_vectors_a_validation_column_weights_and_a_transformation_fn(spark, tmp_path):
    rows = [
        (
            SparseVector(4, {i % 4: 1.0}),
            float(i % 4),
            float(i),
            [float(i), 1.0],
            i % 5 == 0,
            1.0 + i % 2,
        )
        for i in range(120)
    ]
    schema = StructType(
        [
            StructField("sparse", VectorUDT()),
            StructField("scalar", DoubleType()),
            StructField("label", DoubleType()),
            StructField("arr", ArrayType(DoubleType())),
            StructField("val", BooleanType()),
            StructField("weight", DoubleType()),
        ]
    )
    df = spark.createDataFrame(rows, schema)
    marks = str(tmp_path / "marks")
    os.makedirs(marks)

    def mark(batch):
        open(os.path.join(marks, str(os.getpid())), "w").close()
        return {**batch, "label": batch["label"] * 0.01}

    class Three(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4 + 1 + 2, 1)

        def forward(self, sparse, scalar, arr):
            return self.linear(torch.cat([sparse, scalar, arr], dim=1))

    torch.manual_seed(0)
    module = Three()
    store = tmp_path / "store"
    estimator = _regressor(
        str(store),
        model=module,
        optimizer=torch.optim.SGD(module.parameters(), lr=0.01),
        feature_cols=["sparse", "scalar", "arr"],
        label_cols=["label"],
        validation="val",
        sample_weight_col="weight",
        transformation_fn=mark,
        epochs=1,
    )
    model = estimator.fit(df)
    assert "val_loss" in model.getHistory()[0]
    val = Store.create(str(store)).parquet_dataset(Store.create(str(store)).get_val_data_path(0))
    assert val.count_rows() == 24 and "weight" in val.schema.names and "val" not in val.schema.names
    # both workers ran the transformation (the driver also runs it once in its pre-job check)
    assert len(set(os.listdir(marks)) - {str(os.getpid())}) == 2
    assert model.getFeatureShapes() == [[4], [1], [2]]


def test_sample_weights_weigh_each_rows_loss():
    mse = (
        torch.nn.MSELoss()
    )  # batch_loss takes one label column's loss fn (issue 23's per-label losses)
    output, target = torch.tensor([[1.0], [3.0]]), torch.tensor([[0.0], [0.0]])
    weighted = batch_loss(mse, output, target, torch.tensor([1.0, 0.0]))
    assert float(weighted) == pytest.approx(0.5)  # mean(weight * per-row loss) = (1 + 0) / 2
    assert mse.reduction == "mean"  # restored
    assert float(batch_loss(mse, output, target, None)) == pytest.approx(5.0)
    scalar = lambda o, t: ((o - t) ** 2).mean()  # noqa: E731
    with pytest.raises(ValueError, match="one number for the batch"):
        batch_loss(scalar, output, target, torch.ones(2))


# --- errors, and nothing left behind -------------------------------------------------------


@pytest.mark.spark
@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"validation": "x0"},
            "validation column 'x0' has type double; it must be boolean or integer",
        ),
        ({"validation": "missing"}, "validation column 'missing' is not in the DataFrame"),
        (
            {"feature_cols": ["x0"], "sample_weight_col": "features"},
            "sample weight column .features. has type vector",
        ),
        ({"store": "memory://ringtrain-test"}, "lives in the driver's memory"),
    ],
)
def test_bad_data_params_are_refused_before_any_job(spark, assembled, overrides, message):
    sc = spark.sparkContext
    group = f"refused-{abs(hash(message))}"
    sc.setJobGroup(group, "must stay empty")
    try:
        with pytest.raises(ValueError, match=message):
            _regressor(**{"store": None, **overrides}).fit(assembled)
        assert sc.statusTracker().getJobIdsForGroup(group) == []
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)


@pytest.mark.spark
def test_map_and_struct_columns_are_refused_naming_type_and_fix(spark):
    df = spark.sql("SELECT map('a', 1.0) AS m, named_struct('a', 1.0) AS s, 1.0 AS y")
    with pytest.raises(
        ValueError, match=r"feature column 'm' has type map<string,decimal.*setFeatureCols"
    ):
        _regressor(None, feature_cols=["m"]).fit(df)
    with pytest.raises(ValueError, match=r"feature column 's' has type struct<a:decimal"):
        _regressor(None, feature_cols=["s"]).fit(df)


@pytest.mark.spark
def test_a_fit_failing_in_data_preparation_leaves_no_data_and_no_run(spark, tmp_path):
    schema = StructType([StructField("x", DoubleType()), StructField("y", LongType())])
    nulls = spark.createDataFrame([(float(i) if i % 7 else None, i % 2) for i in range(40)], schema)
    with pytest.raises(ValueError, match=r"column 'x' of the training data has \d+ null value"):
        _regressor(str(tmp_path), feature_cols=["x"], label_cols=["y"]).fit(nulls)
    one_row = spark.createDataFrame([(1.0, 1)], schema)
    with pytest.raises(ValueError, match="fewer than num_proc=2"):
        _regressor(str(tmp_path), feature_cols=["x"], label_cols=["y"]).fit(one_row)
    assert os.listdir(tmp_path) == []


# --- CrossValidator ----------------------------------------------------------------------------


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.reliability(
    fault="a run_id set under CrossValidator (each fit would resume the last one's run)",
    category="bad-input",
)
def test_cross_validator_with_a_set_run_id_trains_every_grid_point_and_fold(assembled, tmp_path):
    estimator = _regressor(str(tmp_path), epochs=1, run_id="grid")
    grid = ParamGridBuilder().addGrid(estimator.batch_size, [8, 64]).build()
    evaluator = RegressionEvaluator(predictionCol="y__output", labelCol="y", metricName="rmse")
    cv = CrossValidator(
        estimator=estimator, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=2
    )
    fitted = cv.fit(assembled)
    assert len(fitted.avgMetrics) == 2 and all(np.isfinite(fitted.avgMetrics))
    assert isinstance(fitted.bestModel, RingModel)
    store = Store.create(str(tmp_path))
    runs = sorted(os.listdir(store.get_runs_path()))
    assert len(runs) == 5, runs  # 2 grid points x 2 folds, and the final refit on all rows
    for run in runs:  # each trained its epoch: none resumed another's finished run
        assert len(store.read_json(store.get_history_path(run))) == 1, run
