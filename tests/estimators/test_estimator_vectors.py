"""estimators: ``RingModel.transform`` types each output column from its label — a Spark ML
Vector label gives a dense Vector column, an array label ``array<double>``, a scalar
label ``double`` — and keeps doing so after save/load and inside a saved PipelineModel.
Real Spark (local[2]), two Gloo workers."""

from __future__ import annotations

import _spark
import numpy as np
import pytest
import torch
from pyspark.ml import PipelineModel
from pyspark.ml.linalg import DenseVector, Vectors, VectorUDT
from pyspark.sql.types import ArrayType, DoubleType

from estimators import RingEstimator, RingModel
from estimators.fit._cache import clear_cache

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

ROWS = 64


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


@pytest.fixture(scope="module")
def data(spark):
    rng = np.random.default_rng(7)
    x = rng.normal(size=(ROWS, 4))
    rows = [
        (i, x[i].tolist(), Vectors.dense(x[i, :2] * 2.0), (x[i, 1:] - 1.0).tolist(), float(x[i, 3]))
        for i in range(ROWS)
    ]
    return spark.createDataFrame(rows, ["id", "x", "yv", "ya", "ys"]), x


def _three_heads() -> torch.nn.Module:
    class ThreeHeads(torch.nn.Module):  # local: cloudpickled by value to the workers
        """One output per label: 2 values (Vector label), 3 (array label), 1 (scalar)."""

        def __init__(self):
            super().__init__()
            self.vector = torch.nn.Linear(4, 2)
            self.array = torch.nn.Linear(4, 3)
            self.scalar = torch.nn.Linear(4, 1)

        def forward(self, x):
            return self.vector(x), self.array(x), self.scalar(x)

    return ThreeHeads()


@pytest.fixture(scope="module")
def fitted(data, tmp_path_factory):
    clear_cache()
    torch.manual_seed(0)
    model = _three_heads()
    estimator = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["yv", "ya", "ys"],
        batch_size=8,
        epochs=1,
        num_proc=2,
        random_seed=1,
        verbose=0,
        store=str(tmp_path_factory.mktemp("vectors-store")),
    )
    return estimator.fit(data[0])


def _local_forward(model: RingModel, x: np.ndarray) -> list[np.ndarray]:
    module = model.getModel().eval()
    with torch.no_grad():
        outputs = module(torch.tensor(x, dtype=torch.float32))
    return [o.double().numpy() for o in outputs]


def _check_outputs(model: RingModel, df, x: np.ndarray) -> None:
    out = model.transform(df)
    types = {f.name: f.dataType for f in out.schema.fields}
    assert isinstance(types["yv__output"], VectorUDT)
    assert types["ya__output"] == ArrayType(DoubleType(), containsNull=False)
    assert types["ys__output"] == DoubleType()
    rows = out.orderBy("id").collect()
    assert all(isinstance(r["yv__output"], DenseVector) for r in rows)
    vector, array, scalar = _local_forward(model, x)
    np.testing.assert_allclose([r["yv__output"].toArray() for r in rows], vector, rtol=1e-5)
    np.testing.assert_allclose([r["ya__output"] for r in rows], array, rtol=1e-5)
    np.testing.assert_allclose([r["ys__output"] for r in rows], scalar[:, 0], rtol=1e-5)


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_vector_array_and_scalar_labels_give_vector_array_and_double_outputs_after_save_load(
    fitted, data, tmp_path
):
    df, x = data
    assert fitted.getLabelKinds() == ["vector", "array", "scalar"]
    _check_outputs(fitted, df, x)

    fitted.save(str(tmp_path / "model"))
    loaded = RingModel.load(str(tmp_path / "model"))
    assert loaded.getLabelKinds() == ["vector", "array", "scalar"]
    _check_outputs(loaded, df, x)

    PipelineModel(stages=[fitted]).save(str(tmp_path / "pipeline"))
    in_pipeline = PipelineModel.load(str(tmp_path / "pipeline")).stages[-1]
    assert in_pipeline.getLabelKinds() == ["vector", "array", "scalar"]
    _check_outputs(in_pipeline, df, x)


@pytest.mark.spark
@pytest.mark.timeout(60)
def test_a_vector_label_of_one_value_per_row_gives_vectors_of_size_one(spark, data):
    df, x = data
    torch.manual_seed(0)
    module = torch.nn.Linear(4, 1)
    model = RingModel(model=module, feature_cols=["x"], label_cols=["y"], label_kinds=["vector"])
    rows = model.transform(df).orderBy("id").collect()
    with torch.no_grad():
        expected = module(torch.tensor(x, dtype=torch.float32)).double().numpy()
    assert all(isinstance(r["y__output"], DenseVector) and r["y__output"].size == 1 for r in rows)
    np.testing.assert_allclose([r["y__output"].toArray() for r in rows], expected, rtol=1e-5)


@pytest.mark.spark
@pytest.mark.timeout(60)
def test_bad_label_kinds_are_refused_naming_the_value_and_the_count(data):
    with pytest.raises(ValueError, match=r"'scalar', 'array', 'vector'.*'matrix'"):
        RingModel(label_kinds=["matrix"])
    model = RingModel(
        model=torch.nn.Linear(4, 1), feature_cols=["x"], label_cols=["y"], label_kinds="scalar"
    )
    assert model.getLabelKinds() == ["scalar"]
    model.setLabelKinds(["vector", "array"])
    with pytest.raises(ValueError, match=r"label_kinds names 2 kind.*setLabelKinds"):
        model.transform(data[0])
