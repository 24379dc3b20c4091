"""Estimator benchmark: ``RingEstimator.fit`` against the same training written by hand
with ``TorchDistributor`` + Petastorm + DDP, and ``RingModel.transform`` against a plain
``pandas_udf`` doing the same forward pass. Spark ``local[2]``, 2 workers.

Data: ``--rows`` generated rows (default 100,000) x 64 float features (an ``array<float>``
column) and a float label. The estimator's first fit (a warm-up, not timed) writes the
Parquet into its store; every timed fit reuses it (the prepared-data cache), and the
hand-written version reads the very same files. Model: MLP 64-128-1, SGD, MSE, batch 256
per worker, 2 epochs. Peers alternate, ``--rounds`` rounds (default 2) of fits and
``--transform-rounds`` (default 6) of transforms, after two warm-up transforms each (the
first one on a fresh task pays for imports); the table quotes median against median and
lists every round.

Fit, ours: ``RingEstimator(...).fit(df)`` (new ``run_id`` each round, so no resume): a
barrier stage of 2 tasks, Gloo ring, Petastorm reader, a checkpoint per epoch, the
final model loaded on the driver. Theirs: ``TorchDistributor(num_processes=2,
local_mode=False, use_gpu=False).run(train_fn, path)``: each task starts ``torchrun``,
``init_process_group("gloo")``, DDP, ``make_batch_reader`` on its shard, 256-row slices,
rank 0 returns the state_dict. Transform, ours: ``model.transform(df)``; theirs: the
state_dict broadcast, an Iterator[pd.Series] -> Iterator[pd.Series] ``pandas_udf`` that
builds the model once per task; both written to Spark's ``noop`` sink.

Prints a table and writes bench/results/estimator.json.
Usage: python bench/estimator.py [--rows 100000] [--rounds 2] [--transform-rounds 6]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pandas as pd
import torch

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
FEATURES, HIDDEN, BATCH, EPOCHS, LR = 64, 128, 256, 2, 0.01


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, 1)
    )


def _data(spark: Any, rows: int) -> Any:
    from pyspark.sql import functions as F

    x = F.array(*[F.rand(seed=i).cast("float") for i in range(FEATURES)])
    df = spark.range(rows).select(x.alias("x"))
    weights = F.lit(0.0)
    for i in range(8):
        weights = weights + F.col("x")[i] * float(i - 4)
    return df.select("x", (weights + F.rand(seed=99) * 0.1).alias("y")).cache()


def _estimator(store: str, run_id: str) -> Any:
    from estimators import RingEstimator

    model = _mlp()
    return RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=LR),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=BATCH,
        epochs=EPOCHS,
        num_proc=2,
        random_seed=1,
        reader="petastorm",
        verbose=0,
        store=store,
        run_id=run_id,
    )


def hand_written_train(url: str, steps: int) -> dict[str, torch.Tensor]:
    """What a user writes for TorchDistributor: DDP + Petastorm on the rank's shard."""
    import torch.distributed as dist
    from petastorm import make_batch_reader
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = DistributedDataParallel(_mlp())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = torch.nn.MSELoss()
    for _ in range(EPOCHS):
        done = 0
        with make_batch_reader(
            url, cur_shard=rank, shard_count=size, num_epochs=1, workers_count=1
        ) as reader:
            for batch in reader:
                x = torch.from_numpy(np.stack(batch.x).astype(np.float32))
                y = torch.from_numpy(np.asarray(batch.y, dtype=np.float32)).reshape(-1, 1)
                for start in range(0, len(y) - BATCH + 1, BATCH):
                    if done == steps:
                        break
                    opt.zero_grad()
                    loss_fn(model(x[start : start + BATCH]), y[start : start + BATCH]).backward()
                    opt.step()
                    done += 1
        if done != steps:
            raise RuntimeError(f"rank {rank} ran {done} steps of {steps}")
    state = {k: v.detach().clone() for k, v in model.module.state_dict().items()}
    dist.destroy_process_group()
    return state if rank == 0 else {}


def _fit_theirs(url: str, steps: int) -> float:
    from pyspark.ml.torch.distributor import TorchDistributor

    start = time.perf_counter()
    state = TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(
        hand_written_train, url, steps
    )
    elapsed = time.perf_counter() - start
    assert set(state) == set(_mlp().state_dict()), "TorchDistributor returned no model"
    return elapsed


def _fit_ours(df: Any, store: str) -> tuple[float, Any]:
    start = time.perf_counter()
    model = _estimator(store, f"bench-{uuid.uuid4().hex[:8]}").fit(df)
    return time.perf_counter() - start, model


def _udf_peer(spark: Any, model: torch.nn.Module) -> Any:
    """A plain pandas_udf a user writes: state_dict broadcast, model built once per task."""
    from pyspark.sql.functions import pandas_udf

    state = spark.sparkContext.broadcast(model.state_dict())

    @pandas_udf("double")
    def predict(batches: Iterator[pd.Series]) -> Iterator[pd.Series]:
        net = _mlp()
        net.load_state_dict(state.value)
        net.eval()
        for x in batches:
            with torch.no_grad():
                out = net(torch.from_numpy(np.stack(x.to_numpy()).astype(np.float32)))
            yield pd.Series(out[:, 0].double().numpy())

    return predict


def _timed_noop(frame: Any) -> float:
    start = time.perf_counter()
    frame.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - start


def _ratio(ours: float, theirs: float) -> float:
    return round(ours / theirs, 3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--transform-rounds", type=int, default=6)
    args = parser.parse_args()

    import spark_runner
    from estimators import Store

    spark = spark_runner.local_session(
        "local[2]", app_name="bench-estimator", conf={"spark.sql.shuffle.partitions": "2"}
    )
    spark.sparkContext.setLogLevel("ERROR")
    prefix = tempfile.mkdtemp(prefix="bench-estimator-")
    try:
        df = _data(spark, args.rows)
        df.count()
        _, model = _fit_ours(df, prefix)  # warm-up: writes the Parquet once, into the store
        train_path = Store.create(prefix).get_train_data_path(0)
        url = pathlib.Path(train_path).resolve().as_uri()
        steps = args.rows // (BATCH * 2)  # the estimator's train_steps_per_epoch default
        features = spark.read.parquet(train_path).select("x").cache()
        features.count()
        udf = _udf_peer(spark, model.getModel())
        for _ in range(2):  # warm-up of both transforms
            _timed_noop(model.transform(features))
            _timed_noop(features.select("x", udf("x").alias("y__output")))

        fit: dict[str, list[float]] = {"ours": [], "theirs": []}
        transform: dict[str, list[float]] = {"ours": [], "theirs": []}
        for r in range(args.rounds):
            order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
            for peer in order:
                if peer == "ours":
                    fit["ours"].append(_fit_ours(df, prefix)[0])
                else:
                    fit["theirs"].append(_fit_theirs(url, steps))
        for r in range(args.transform_rounds):
            order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
            for peer in order:
                frame = (
                    model.transform(features)
                    if peer == "ours"
                    else features.select("x", udf("x").alias("y__output"))
                )
                transform[peer].append(args.rows / _timed_noop(frame))
        _report(args, fit, transform, steps)
    finally:
        spark.stop()


def _report(args: Any, fit: dict, transform: dict, steps: int) -> None:
    fit_ratio = _ratio(statistics.median(fit["ours"]), statistics.median(fit["theirs"]))
    tr_ratio = _ratio(statistics.median(transform["ours"]), statistics.median(transform["theirs"]))
    rows = [
        ("fit wall s (lower is better)", fit, fit_ratio, "<= 1.1", fit_ratio <= 1.1),
        ("transform rows/s (higher)", transform, tr_ratio, ">= 1.0", tr_ratio >= 1.0),
    ]
    print(f"{'measure':30} {'ours median':>12} {'theirs median':>14} {'ratio':>6}  target")
    for name, values, ratio, target, met in rows:
        ours, theirs = statistics.median(values["ours"]), statistics.median(values["theirs"])
        verdict = "met" if met else "MISSED"
        print(f"{name:30} {ours:>12,.1f} {theirs:>14,.1f} {ratio:>6}  {target} {verdict}")
    for name, values, *_ in rows:
        for peer in ("ours", "theirs"):
            print(
                f"  {name.split(' (')[0]}, {peer}, every round: "
                + ", ".join(f"{v:,.1f}" for v in values[peer])
            )
    result = {
        "bench": "estimator",
        "rows": args.rows,
        "features": FEATURES,
        "model": f"MLP {FEATURES}-{HIDDEN}-1",
        "epochs": EPOCHS,
        "batch_per_worker": BATCH,
        "steps_per_epoch": steps,
        "workers": 2,
        "master": "local[2]",
        "rounds": args.rounds,
        "transform_rounds": args.transform_rounds,
        "statistic": "median of the rounds",
        "fit_seconds": fit,
        "fit_ratio_ours_over_torchdistributor_median": fit_ratio,
        "fit_target": "<= 1.1",
        "fit_target_met": fit_ratio <= 1.1,
        "transform_rows_per_s": transform,
        "transform_ratio_ours_over_pandas_udf_median": tr_ratio,
        "transform_target": ">= 1.0",
        "transform_target_met": tr_ratio >= 1.0,
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "estimator.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
