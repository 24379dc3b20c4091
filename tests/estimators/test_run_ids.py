"""A fit's ``run_id``: one outside the store is refused before any job or write, and a
fit with other params does not resume a run it did not write (CrossValidator with a set
``run_id``: test_estimator_persistence, on every stack)."""

from __future__ import annotations

import logging
import os

import _spark
import pytest
import torch

from estimators import Store

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


BAD_RUN_IDS = ["/etc", "../other", "..", "a/../../b", ".hidden", "", "a/b", "run\\x", "-x"]


@pytest.mark.reliability(
    fault="bad estimator input (params, columns, data)",
    category="bad-input",
    cases=len(BAD_RUN_IDS),
)
def test_a_run_id_outside_the_store_is_refused_naming_the_value_and_the_form(tmp_path):
    store = Store.create(str(tmp_path / "store"))
    for run_id in BAD_RUN_IDS:
        with pytest.raises(ValueError, match="is not a folder name under <store>/runs/") as info:
            store.get_checkpoint_path(run_id)
        assert repr(run_id) in str(info.value) and "setRunId" in str(info.value)
    assert store.get_run_path("run_2026-12-03.a").endswith("/runs/run_2026-12-03.a")
    assert not os.path.exists(tmp_path / "store")


@pytest.mark.spark
@pytest.mark.reliability(fault="bad estimator input (params, columns, data)", category="bad-input")
def test_fit_with_an_escaping_run_id_fails_before_any_job_or_write(spark, tmp_path):
    from estimators import RingEstimator

    frame = spark.createDataFrame([([float(i)], float(i)) for i in range(8)], ["x", "y"])
    model = torch.nn.Linear(1, 1)
    est = RingEstimator(
        num_proc=1,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        store=Store.create(str(tmp_path / "store")),
        run_id="../../escaped",
        verbose=0,
    )
    tracker = spark.sparkContext.statusTracker()
    jobs_before = len(tracker.getJobIdsForGroup(None))
    with pytest.raises(ValueError, match=r"run_id '\.\./\.\./escaped' is not a folder name"):
        est.fit(frame)
    assert len(tracker.getJobIdsForGroup(None)) == jobs_before
    assert not (tmp_path / "escaped").exists()
    assert not (tmp_path / "store").exists() or os.listdir(tmp_path / "store") == []


def _regressor(store_path: str, **params):
    from estimators import RingEstimator

    torch.manual_seed(0)
    model = torch.nn.Linear(2, 1)
    return RingEstimator(
        num_proc=1,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        store=Store.create(store_path),
        verbose=0,
        random_seed=1,
        **params,
    )


def test_a_fit_with_other_params_runs_apart_from_a_run_id_it_did_not_write(tmp_path, caplog):
    from estimators.store._runs import record_run, run_to_use

    store = Store.create(str(tmp_path))
    first = {"batch_size": 8, "loss": "MSELoss()", "data": "1"}
    assert run_to_use(store, "grid", first) == "grid"
    record_run(store, "grid", first)
    store.write_atomic(store.get_checkpoint_path("grid"), lambda f: torch.save({"epoch": 1}, f))
    assert run_to_use(store, "grid", dict(first)) == "grid"  # the same fit: resumes
    second = {**first, "batch_size": 64}
    with caplog.at_level(logging.WARNING, logger="ringtrain.estimators"):
        other = run_to_use(store, "grid", second)
    assert other.startswith("grid.") and other != "grid"
    assert "batch_size: 8 then, 64 now" in caplog.text and repr(other) in caplog.text
    record_run(store, other, second)
    store.write_atomic(store.get_checkpoint_path(other), lambda f: torch.save({"epoch": 1}, f))
    assert run_to_use(store, "grid", second) == other  # and it resumes its own run
    legacy = "written-before"  # a run with no fingerprint is resumed as before
    store.write_atomic(store.get_checkpoint_path(legacy), lambda f: torch.save({"epoch": 1}, f))
    assert run_to_use(store, legacy, second) == legacy
