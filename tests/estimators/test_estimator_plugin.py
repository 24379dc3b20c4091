"""A framework registered from outside the package fits and transforms like a built-in one.

``tests/toy_framework`` is one folder and one ``register_framework`` call: a numpy
linear model with its own worker loop, checkpoint and Arrow predictor. Given to
``RingEstimator``, it goes through the generic fit path (resolve, check the DataFrame,
write Parquet, launch on the Spark stage, build) and ``RingModel.transform`` without a
line of ``estimators`` knowing it: the proof that the fit path never branches on a
framework.
"""

from __future__ import annotations

import _spark
import numpy as np
import pytest
import toy_framework
from pyspark.sql import functions as F

from estimators import RingEstimator, RingModel, Store
from estimators.frameworks import framework_of, registered_frameworks

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)


@pytest.fixture(scope="module")
def spark():
    return _spark.shared_session()  # never stopped here: see tests/_spark.py


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_a_framework_registered_from_outside_fits_and_transforms_through_ring_estimator(
    spark, tmp_path
):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 2))
    rows = [([float(a), float(b)], float(3 * a - 2 * b + 0.5)) for a, b in x]
    df = spark.createDataFrame(rows, ["x", "y"])
    model = toy_framework.LinearModel(np.zeros(2), lr=0.2)
    assert framework_of(model).name == "numpy-linear" == registered_frameworks()[-1]
    fitted = RingEstimator(
        model=model,
        feature_cols=["x"],
        label_cols=["y"],
        num_proc=2,
        epochs=40,
        batch_size=4,
        verbose=0,
        store=Store.create(str(tmp_path / "store")),
        run_id="toy",
    ).fit(df)
    assert isinstance(fitted, RingModel) and isinstance(
        fitted.getModel(), toy_framework.LinearModel
    )
    history = fitted.getHistory()
    assert [e["epoch"] for e in history] == list(range(1, 41))
    assert history[-1]["train_loss"] < 1e-3 < history[0]["train_loss"]  # learned, on 2 ranks
    np.testing.assert_allclose(fitted.getModel().weights, [3.0, -2.0], atol=0.05)
    out = fitted.transform(df).select("y", F.col("y__output")).collect()
    assert len(out) == 64
    np.testing.assert_allclose([r["y__output"] for r in out], [r["y"] for r in out], atol=0.1)
