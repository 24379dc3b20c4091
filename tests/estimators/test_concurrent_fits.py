"""Load: several fits at once on one SparkSession and one store (a notebook's parallel
cells, CrossValidator with ``parallelism``, two users on one cluster). Each fit is a
thread of the driver; each trains its own run to the model a fit alone gives, with its
own checkpoint, and nothing of one leaks into another. The fits do train at the same
time: each fit's rank 0 waits, as its training starts, until another fit's has started
too (up to a minute), and the test checks their training spans overlapped."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch
from _reliability import record

import spark_runner
from estimators import RingEstimator, Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]

FITS, EPOCHS, ROWS = 3, 2, 96


@pytest.fixture(scope="module")
def spark():
    # 4 slots: two fits' barrier stages run together, the third waits for slots
    session = spark_runner.local_session(
        "local[4]", app_name="test_concurrent_fits", log_level="ERROR",
        conf={"spark.sql.shuffle.partitions": "2"},
    )  # fmt: skip
    try:
        yield session
    finally:
        session.stop()


def _overlap_recorder(marks: str, name: str):
    """A callback: rank 0 notes (in ``marks``) when this fit's training begins and ends;
    at the beginning it waits, up to a minute, until another fit's has begun too."""
    from estimators import Callback

    def note(what: str) -> None:
        with open(os.path.join(marks, f"{name}.{what}"), "w") as f:
            f.write(repr(time.time()))

    class Overlap(Callback):
        def on_train_begin(self, logs):
            if self.rank != 0:
                return
            note("begin")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                if sum(n.endswith(".begin") for n in os.listdir(marks)) >= 2:
                    return
                time.sleep(0.05)

        def on_train_end(self, logs):
            if self.rank == 0:
                note("end")

    return Overlap()


def _spans(marks: str) -> dict[str, tuple[float, float]]:
    def at(name: str) -> float:
        with open(os.path.join(marks, name)) as f:
            return float(f.read())

    names = sorted(n[: -len(".begin")] for n in os.listdir(marks) if n.endswith(".begin"))
    return {n: (at(f"{n}.begin"), at(f"{n}.end")) for n in names}


def _estimator(store: Store, run_id: str, seed: int, **extra) -> RingEstimator:
    torch.manual_seed(seed)
    model = torch.nn.Linear(4, 2)
    return RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=8,
        epochs=EPOCHS,
        num_proc=2,
        reader="arrow",
        verbose=0,
        random_seed=seed,
        store=store,
        run_id=run_id,
        **extra,
    )


@pytest.mark.reliability(
    fault="several fits at once on one SparkSession and one store", category="load", cases=FITS
)
@pytest.mark.timeout(600)
def test_concurrent_fits_on_one_session_and_store_each_end_as_a_fit_alone(spark, tmp_path, request):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4))
    df = spark.createDataFrame([(r.tolist(), int(r.sum() > 0)) for r in x], ["x", "y"])
    store = Store.create(str(tmp_path / "store"))
    results: dict[int, object] = {}
    errors: dict[int, BaseException] = {}

    # built here, one after another: torch.manual_seed is process-wide, so models
    # built in the threads would take each other's initial weights
    marks = str(tmp_path / "marks")
    os.makedirs(marks)
    estimators = [
        _estimator(store, f"concurrent{i}", seed=i, callbacks=[_overlap_recorder(marks, str(i))])
        for i in range(FITS)
    ]

    def fit(i: int) -> None:
        try:
            results[i] = estimators[i].fit(df)
        except BaseException as exc:
            errors[i] = exc

    started = time.monotonic()
    threads = [threading.Thread(target=fit, args=(i,), name=f"fit{i}") for i in range(FITS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(540)
    together = time.monotonic() - started
    assert not any(t.is_alive() for t in threads), "a concurrent fit did not finish"
    assert errors == {}, errors
    spans = _spans(marks)  # each fit's training, begin to end: two at least overlap
    assert len(spans) == FITS, spans
    overlapping = [
        (a, b)
        for a in spans
        for b in spans
        if a < b and max(spans[a][0], spans[b][0]) < min(spans[a][1], spans[b][1])
    ]
    assert overlapping, f"the fits trained one after another: {spans}"
    # each run: its own complete history and checkpoint, and the model a fit alone gives
    for i in range(FITS):
        model = results[i]
        assert [e["epoch"] for e in model.getHistory()] == list(range(1, EPOCHS + 1))
        ckpt = torch.load(store.get_checkpoint_path(f"concurrent{i}"), weights_only=True)
        assert ckpt["epoch"] == EPOCHS
        alone = _estimator(store, f"alone{i}", seed=i).fit(df)
        for name, value in alone.getModel().state_dict().items():
            assert torch.allclose(model.getModel().state_dict()[name], value, atol=1e-5), (i, name)
    # the runs differ (seeds 0..2), so no run's state was another's
    weights = [results[i].getModel().state_dict()["weight"] for i in range(FITS)]
    assert not torch.allclose(weights[0], weights[1])
    leftovers = [
        os.path.join(root, name)
        for root, _, names in os.walk(store.prefix_path)
        for name in names
        if ".tmp" in name
    ]
    assert leftovers == []
    record(
        request,
        cases=FITS,
        note=f"{FITS} fits together in {together:.0f} s; trained at once: {overlapping}",
    )
