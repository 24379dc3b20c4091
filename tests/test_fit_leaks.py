"""Load: 20 consecutive tiny fits in one SparkSession leak no threads, processes, ports or
file handles of the driver (counted with psutil after a warm-up, then bounded)."""

from __future__ import annotations

import numpy as np
import psutil
import pytest
import torch
from _reliability import record

import spark_runner
from estimators import RingEstimator, Store

FITS = 20
WARM_UP = 3


@pytest.fixture(scope="module")
def spark():
    session = spark_runner.local_session(
        "local[2]", app_name="test_fit_leaks", conf={"spark.sql.shuffle.partitions": "2"}
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


def _counts() -> dict[str, int]:
    me = psutil.Process()
    return {
        "threads": me.num_threads(),
        "descendants": len(me.children(recursive=True)),
        "listening": sum(1 for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN),
        "connections": len(me.net_connections("inet")),
        "fds": me.num_fds(),
    }


# What a fit may leave running between fits without leaking: a few pooled threads, the
# Python workers Spark keeps for reuse (up to the slots), sockets in their keep-alive.
SLACK = {"threads": 4, "descendants": 2, "listening": 1, "connections": 4, "fds": 12}


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.reliability(fault="20 consecutive fits in one SparkSession", category="load")
@pytest.mark.timeout(400)
def test_twenty_fits_in_one_session_leak_no_threads_processes_ports_or_files(
    spark, tmp_path, request
):
    rng = np.random.default_rng(0)
    rows = [(rng.normal(size=4).tolist(), int(rng.integers(0, 2))) for _ in range(32)]
    df = spark.createDataFrame(rows, ["x", "y"])
    seen = []
    for i in range(FITS):
        torch.manual_seed(i)
        model = torch.nn.Linear(4, 2)
        fitted = RingEstimator(
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
            random_seed=i,
            store=Store.create(str(tmp_path / f"store{i % 2}")),  # alternate: write, reuse
            run_id=f"fit{i}",
        ).fit(df)
        assert [e["epoch"] for e in fitted.getHistory()] == [1]
        seen.append(_counts())
    warm = {k: max(c[k] for c in seen[WARM_UP - 1 : WARM_UP + 2]) for k in SLACK}
    late = {k: max(c[k] for c in seen[FITS // 2 :]) for k in SLACK}
    grown = {k: late[k] - warm[k] for k in SLACK}
    assert all(grown[k] <= SLACK[k] for k in SLACK), (grown, seen)
    record(request, cases=FITS, note=", ".join(f"{k} +{v}" for k, v in grown.items()))
