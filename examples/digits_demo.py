"""``make demo``: train an MLP on scikit-learn's digits with 2 workers.

Run it as ``python examples/digits_demo.py`` from the repository's root, with ringtrain
installed (``make demo`` does both).

The digits (1,797 8x8 images, bundled with scikit-learn: no download) become a
Spark DataFrame of ML Vectors on ``local[2]``; ``RingEstimator`` trains a 64-64-10
MLP with Adam on two ranks for 10 epochs, printing each epoch's metrics; the
fitted ``RingModel`` then scores the held-out split on the executors.
"""

from __future__ import annotations

import sys
import tempfile
import time

import numpy as np
import torch
from pyspark.ml.functions import array_to_vector
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

import spark_runner
from estimators import RingEstimator, RingModel, Store

HELD_OUT = 0.2
SEED = 7


def digits_frame(spark: SparkSession) -> DataFrame:
    """The digits as ``features`` (an ML Vector of 64 pixels in [0, 1]) and ``label``."""
    import pandas as pd
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    pixels = pd.DataFrame({"pixels": list(images / 16.0), "label": labels.astype(np.int64)})
    frame = spark.createDataFrame(pixels)  # through Arrow: no Python rows to re-read per job
    return frame.select(array_to_vector(F.col("pixels")).alias("features"), "label")


def make_estimator(store: Store, epochs: int = 10) -> RingEstimator:
    torch.manual_seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    return RingEstimator(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
        loss=torch.nn.CrossEntropyLoss(),
        metrics=["accuracy"],
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=epochs,
        num_proc=2,
        validation=0.1,
        store=store,
        random_seed=SEED,
    )


def held_out_accuracy(model: RingModel, df: DataFrame) -> float:
    """Accuracy of the argmax of the ``label__output`` logits the executors computed."""
    rows = model.transform(df).select("label", "label__output").collect()
    labels = np.array([r["label"] for r in rows])
    predicted = np.array([np.argmax(r["label__output"]) for r in rows])
    return float((labels == predicted).mean())


def main() -> int:
    started = time.monotonic()
    spark = spark_runner.local_session(
        "local[2]", app_name="ringtrain-demo", conf={"spark.sql.shuffle.partitions": "2"}
    )
    try:
        spark.sparkContext.setLogLevel("ERROR")
        train_df, test_df = digits_frame(spark).randomSplit([1 - HELD_OUT, HELD_OUT], seed=SEED)
        store = Store.create(tempfile.mkdtemp(prefix="ringtrain-demo-"))
        print(f"training a 64-64-10 MLP on the digits with 2 workers; store: {store.prefix_path}")
        fitted = make_estimator(store).fit(train_df)
        last = fitted.getHistory()[-1]
        print(f"final validation accuracy: {last['val_accuracy']:.4f}")
        print(f"checkpoint: {store.find_checkpoint(fitted.getRunId())}")
        accuracy = held_out_accuracy(fitted, test_df)
        print(f"held-out accuracy: {accuracy:.4f}")
        print(f"wall time: {time.monotonic() - started:.1f} s")
        return 0 if accuracy >= 0.9 else 1
    finally:
        spark.stop()


if __name__ == "__main__":
    sys.exit(main())
