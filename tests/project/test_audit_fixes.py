"""Audit fixes: forged worker-error blobs, fits racing on one store, Spark's retry rule,
run_id paths, a params change under one run_id, checkpoint durability. (Temp-file
cleanup: tests/estimators/test_stores.py and tests/estimators/test_checkpoint_fencing.py.)"""

from __future__ import annotations

import base64
import io
import logging
import os
import pickle
import threading
import uuid
import zlib

import _spark
import pytest
import torch

import spark_runner
from estimators import FsspecStore, Store
from ringcore import WorkerError
from ringcore.launch import (
    MAX_LINE_BYTES,
    LogConnection,
    LogServer,
    decode_worker_error,
    encode_worker_error,
    find_worker_error,
    signed_blob,
    task_failure_text,
)
from spark_runner._slots import retries_configured, task_max_failures

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

# --- 1. a worker-error blob forged in an exception message ------------------------------------


class _CreatesFileWhenUnpickled:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))  # unpickling opens (creates) the file


def _forged_markers(path: str) -> str:
    """What a row value can hold: our markers around a pickle that creates ``path``, bare
    (the old format) and behind a made-up tag."""
    blob = base64.b64encode(zlib.compress(pickle.dumps(_CreatesFileWhenUnpickled(path))))
    text = blob.decode("ascii")
    return (
        f"<<ringtrain-worker-error:{text}:ringtrain-worker-error>> "
        f"<<ringtrain-worker-error:{'ab' * 32}:{text}:ringtrain-worker-error>>"
    )


@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
    cases=3,
)
def test_a_forged_worker_error_blob_is_never_unpickled_and_the_real_error_still_decodes(
    tmp_path, caplog
):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target))
    secret = uuid.uuid4().hex
    with caplog.at_level(logging.WARNING, logger="ringtrain.ringcore.launch"):
        assert decode_worker_error(f"Py4JJavaError: ... KeyError: {forged!r}", secret) is None
        assert decode_worker_error(f"... {forged} ...", None) is None  # no secret: nothing
    assert not target.exists()
    assert "did not sign" in caplog.text
    real = WorkerError(1, "127.0.0.1", "KeyError", repr(forged), "Traceback ...", "")
    text = f"Job aborted: RuntimeError: {encode_worker_error(real, secret)}"
    got = decode_worker_error(text, secret)
    assert not target.exists()
    assert got is not None and (got.rank, got.error_type) == (1, "KeyError")
    assert decode_worker_error(text, uuid.uuid4().hex) is None  # another job's secret
    assert not target.exists()


@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
)
def test_a_blob_on_the_log_connection_is_unpickled_only_when_this_jobs_secret_signed_it(
    tmp_path,
):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target)).split()[1]  # behind a made-up tag
    out = io.StringIO()
    server = LogServer(out, out)
    try:
        conn = LogConnection("127.0.0.1", server.port, server.secret, stage_id=0)
        real = WorkerError(1, "127.0.0.1", "ValueError", "bad shard", "Traceback ...", "")
        conn.send("W", f"{'a' * 16} {forged}")  # a line injected into the connection
        told = task_failure_text(real, server.secret, conn)  # the task's own error
        conn.close()
        server.drain(5.0)
        named = f"RuntimeError: {told} (ringtrain worker error {'a' * 16}: forged)"
        got = find_worker_error(named, server, server.secret)
    finally:
        server.close()
    assert not target.exists(), "the driver unpickled a blob nobody signed"
    assert got is not None and (got.rank, got.message) == (1, "bad shard")
    assert "ringtrain-worker-error" not in told and out.getvalue() == ""


def test_a_huge_worker_error_still_fits_one_log_line_with_its_message_and_the_traceback_end():
    secret = uuid.uuid4().hex
    huge = os.urandom(1 << 20).hex()  # 2 MB that do not compress
    err = WorkerError(0, "h", "KeyError", huge, "Traceback\n" + huge + "\nKeyError: ...", "")
    blob = signed_blob(err, secret)
    assert len(blob) < MAX_LINE_BYTES
    got = decode_worker_error(blob, secret)
    assert got is not None and got.error_type == "KeyError"
    assert huge.startswith(got.message) and got.traceback.endswith("\nKeyError: ...")


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


def _raises_key_error_of_a_row_value(value: str) -> None:
    raise KeyError(repr(value))  # the message is data, as a missing-key lookup's is


@pytest.mark.spark
@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
)
def test_a_row_value_holding_a_forged_blob_runs_no_code_on_the_driver(spark, tmp_path):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target))
    with pytest.raises(WorkerError) as info:
        spark_runner.run(_raises_key_error_of_a_row_value, args=(forged,), num_proc=1)
    assert not target.exists(), "the driver unpickled a blob from an exception message"
    err = info.value
    assert (err.rank, err.error_type) == (0, "KeyError")
    assert "ringtrain-worker-error" in err.message  # the user's text, readable as it was
    assert "_raises_key_error_of_a_row_value" in err.traceback


@pytest.mark.spark
@pytest.mark.timeout(180)
@pytest.mark.reliability(
    fault="a forged worker-error blob in Spark's failure text (code on the driver)",
    category="security",
)
def test_run_elastic_decodes_only_its_own_tasks_error_blobs(spark, tmp_path):
    target = tmp_path / "pwned"
    forged = _forged_markers(str(target))
    with pytest.raises(WorkerError) as info:
        spark_runner.run_elastic(
            _raises_key_error_of_a_row_value,
            args=(forged,),
            num_proc=1,
            min_num_proc=1,
            max_num_proc=1,
            elastic_timeout=30,
        )
    assert not target.exists(), "the driver unpickled a blob from an exception message"
    assert info.value.error_type == "KeyError" and "ringtrain-worker-error" in info.value.message


# --- 2. two fits claiming data indexes on one store ------------------------------------------


def _race(store: Store, n: int) -> list[int]:
    start, got = threading.Barrier(n), []
    lock = threading.Lock()

    def claim() -> None:
        start.wait()
        idx = store.next_data_index()
        with lock:
            got.append(idx)

    threads = [threading.Thread(target=claim) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


@pytest.fixture
def memory_store():
    store = Store.create(f"memory://ringtrain-audit-{uuid.uuid4().hex[:8]}")
    yield store
    store.rm(store.prefix_path)


@pytest.mark.reliability(
    fault="two fits preparing data in one store at once", category="fault", cases=2
)
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_fits_racing_on_one_store_each_claim_their_own_data_index(kind, tmp_path, memory_store):
    store = Store.create(str(tmp_path)) if kind == "local" else memory_store
    if kind == "local":
        os.makedirs(str(tmp_path / "intermediate_train_data.0"))
    got = _race(store, 8)
    assert len(got) == 8 and len(set(got)) == 8, f"indexes handed out twice: {sorted(got)}"
    if kind == "local":
        assert 0 not in got  # data already there (an older fit's) is not claimed
    for idx in got:
        assert store.exists(store.get_data_claim_path(idx))


@pytest.mark.reliability(fault="two fits preparing data in one store at once", category="fault")
def test_a_failed_preparation_removes_its_own_index_only(tmp_path):
    store = Store.create(str(tmp_path))
    theirs, ours = store.next_data_index(), store.next_data_index()
    assert theirs != ours
    for idx in (theirs, ours):  # both fits wrote (part of) their Parquet
        os.makedirs(store.get_train_data_path(idx))
        os.makedirs(store.get_val_data_path(idx))
    store.release_data_index(ours)  # what prepare_data does when its write fails
    assert store.exists(store.get_train_data_path(theirs))
    assert store.exists(store.get_val_data_path(theirs))
    assert not store.exists(store.get_train_data_path(ours))
    assert not store.exists(store.get_data_claim_path(ours))
    assert store.next_data_index() == ours  # free again


# --- 3. whether Spark retries failed tasks ---------------------------------------------------


@pytest.mark.parametrize(
    ("master", "max_failures", "tries"),
    [
        ("local", None, 1),
        ("local[2]", None, 1),
        ("local[*]", "4", 1),  # local[N] ignores spark.task.maxFailures
        ("local[4,3]", None, 3),
        ("local[2, 1]", "5", 1),
        ("local-cluster[2,1,1024]", None, 4),
        ("spark://master:7077", None, 4),
        ("yarn", None, 4),
        ("k8s://https://10.0.0.1:6443", None, 4),
        ("yarn", "1", 1),
        ("spark://master:7077", "2", 2),
    ],
)
def test_spark_retries_as_its_master_and_max_failures_decide(master, max_failures, tries):
    assert task_max_failures(master, max_failures) == tries
    assert retries_configured(master, max_failures) is (tries > 1)


_RETRY_SCRIPT = """
import json, os, sys
import spark_runner

def fails_on_the_first_attempt_only():
    attempt = int(os.environ[spark_runner.ATTEMPT_ENV_VAR])
    if attempt == 0 and os.environ["RING_RANK"] == "0":
        raise RuntimeError("a transient failure on the first attempt")
    return attempt

spark = spark_runner.local_session(
    "local-cluster[2,1,1024]",
    app_name="test_audit_fixes_retry",
    conf={"spark.executor.cores": "1", "spark.stage.maxConsecutiveAttempts": "2"},
)
spark.sparkContext.setLogLevel("ERROR")
unset = spark.sparkContext.getConf().get("spark.task.maxFailures") is None
try:
    results = spark_runner.run(fails_on_the_first_attempt_only, num_proc=2)
finally:
    spark.stop()
print("RESULT " + json.dumps({"unset": unset, "results": results}))
"""


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.reliability(
    fault="a task of a barrier stage fails on a cluster manager (Spark's default retries)",
    category="fault",
)
def test_on_a_cluster_master_an_unset_max_failures_still_retries_the_stage(tmp_path, request):
    """local-cluster runs Spark's cluster scheduler, where an unset spark.task.maxFailures
    is 4: the failed barrier stage reruns. Its own process: one SparkContext per process.
    Rank 1 returns at once while rank 0 fails: without the all-or-none finish of the task
    (TaskSpec.all_or_none) rank 1's late success kept its output, Spark reran rank 0's
    partition alone and its first allGather waited for ever (the hang CI saw)."""
    import json
    import subprocess
    import sys

    from _reliability import record

    script = tmp_path / "retry.py"
    script.write_text(_RETRY_SCRIPT)
    proc = subprocess.run(
        # ~90 s alone; local-cluster's two executor JVMs start slowly on a loaded machine
        [sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][len("RESULT ") :])
    assert got == {"unset": True, "results": [1, 1]}  # both ranks ran again, as attempt 1
    record(request, note="spark.task.maxFailures unset; the retried stage ran as attempt 1")


# --- 4. paths: run_id -------------------------------------------------------------------------

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


# --- 5. durability of the estimator's checkpoints --------------------------------------------


def _save(store: Store, path: str, epoch: int) -> None:
    state = {"model": {"w": torch.full((64,), float(epoch))}, "epoch": epoch}
    store.write_atomic(path, lambda f: torch.save(state, f))


def _epoch(store: Store, path: str) -> int:
    return int(torch.load(io.BytesIO(store.read_bytes(path)), weights_only=True)["epoch"])


def _damage(store: Store, path: str, how: str) -> None:
    data = store.read_bytes(path)
    if how == "empty":
        data = b""
    elif how == "truncated":
        data = data[: len(data) // 2]
    else:  # a flipped byte inside the tensor data
        i = data.index(b"\x00\x00\x00@" * 8)  # the weights of epoch 2: 2.0 as float32
        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
    if isinstance(store, FsspecStore):
        store.fs.pipe_file(path, data)
    else:
        with open(path, "wb") as f:
            f.write(data)


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
@pytest.mark.parametrize("how", ["empty", "truncated", "corrupt"])
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    kind, how, tmp_path, memory_store, caplog
):
    store = Store.create(str(tmp_path)) if kind == "local" else memory_store
    path = store.get_checkpoint_path("r1")
    _save(store, path, 1)
    _save(store, path, 2)
    assert store.find_checkpoint("r1") == path and _epoch(store, path) == 2
    _damage(store, path, how)
    with caplog.at_level(logging.WARNING, logger="ringtrain.estimators"):
        found = store.find_checkpoint("r1")
    assert found == path + ".prev" and _epoch(store, found) == 1
    assert f"the checkpoint {path} is damaged" in caplog.text


class _FsyncSpy:
    """Records, in order, the paths os.fsync was called on and the os.replace / os.rename
    calls (each still runs: the real filesystem is used)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, str]] = []
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return real_fsync(fd)

        def replace(src, dst, **kw):
            self.events.append(("move", f"{src} -> {dst}"))
            return real_replace(src, dst, **kw)

        def rename(src, dst, **kw):
            self.events.append(("move", f"{src} -> {dst}"))
            return real_rename(src, dst, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "rename", rename)

    def index(self, kind: str, contains: str) -> int:
        for i, (k, what) in enumerate(self.events):
            if k == kind and contains in what:
                return i
        raise AssertionError(f"no {kind} of {contains!r} in {self.events}")


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
def test_a_local_checkpoint_is_fsynced_before_it_replaces_the_last_one(tmp_path, monkeypatch):
    store = Store.create(str(tmp_path))
    path = store.get_checkpoint_path("r1")
    _save(store, path, 1)
    spy = _FsyncSpy(monkeypatch)
    _save(store, path, 2)
    tmp_fsync = spy.index("fsync", f"{path}.tmp-")
    keep = spy.index("move", f"{path} -> {path}.prev")
    install = spy.index("move", ".tmp-")
    folder_fsync = max(
        i for i, (k, w) in enumerate(spy.events) if k == "fsync" and w == os.path.dirname(path)
    )
    assert tmp_fsync < keep < install < folder_fsync, spy.events
    assert _epoch(store, path) == 2 and _epoch(store, path + ".prev") == 1


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
def test_an_empty_checkpoint_after_a_crash_resumes_from_the_previous_one_not_refused(tmp_path):
    from estimators.frameworks.torch._checkpoint import check_resume

    store = Store.create(str(tmp_path))
    model = torch.nn.Linear(64, 1)
    path = store.get_checkpoint_path("crashed")
    for epoch in (1, 2):
        state = {"model": model.state_dict(), "optimizer": {}, "epoch": epoch, "history": []}
        store.write_atomic(path, lambda f, s=state: torch.save(s, f))
    open(path, "wb").close()  # what a host crash before the data reached the disk leaves
    # the driver's check: no ValueError, it resumes
    check_resume(model, store, "crashed", store.find_checkpoint("crashed"))
    found = store.find_checkpoint("crashed")
    assert found == path + ".prev"
    assert torch.load(found, weights_only=True)["epoch"] == 1


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
def test_a_ray_checkpoint_is_fsynced_before_its_commit_and_killed_copies_are_removed(
    tmp_path, monkeypatch
):
    from ray_runner import Checkpoint
    from ray_runner._checkpoint import CheckpointStore

    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "model.pt").write_bytes(b"weights")
    (source / "sub" / "opt.pt").write_bytes(b"state")
    run = tmp_path / "run"
    killed = run / "checkpoint_000000"  # an upload SIGKILLed half-way: no commit record
    killed.mkdir(parents=True)
    (killed / "model.pt").write_bytes(b"")
    store = CheckpointStore(str(run), num_to_keep=1)
    assert store.latest() is None  # never resumed from
    store.remove_uncommitted()  # what the driver does before the next attempt
    assert not killed.exists()
    spy = _FsyncSpy(monkeypatch)
    got = store.persist(Checkpoint.from_directory(source))
    records = str(run / ".ringtrain")
    commit = spy.index("move", f"{records}/checkpoint_")  # the record: write, fsync, rename
    assert spy.index("fsync", "/model.pt") < commit and spy.index("fsync", "/sub/opt.pt") < commit
    assert spy.index("fsync", f"{records}/checkpoint_") < commit
    assert max(i for i, (k, w) in enumerate(spy.events) if k == "fsync" and w == records) > commit
    assert sorted(os.listdir(run)) == [".ringtrain", os.path.basename(got.path)]
    assert (run / os.path.basename(got.path) / "sub" / "opt.pt").read_bytes() == b"state"
    assert store.latest() is not None and store.latest().path == got.path


# --- 4. a run_id set under CrossValidator -----------------------------------------------------


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


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.reliability(
    fault="a run_id set under CrossValidator (each fit would resume the last one's run)",
    category="bad-input",
)
def test_cross_validator_with_a_set_run_id_trains_every_grid_point_and_fold(spark, tmp_path):
    from pyspark.ml.evaluation import RegressionEvaluator
    from pyspark.ml.tuning import CrossValidator, ParamGridBuilder

    rows = [([float(i % 5), float(i % 3)], float(i % 5) - float(i % 3)) for i in range(48)]
    frame = spark.createDataFrame(rows, ["x", "y"])
    store_path = str(tmp_path / "store")
    estimator = _regressor(store_path, epochs=1, run_id="grid")
    grid = ParamGridBuilder().addGrid(estimator.batch_size, [4, 16]).build()
    evaluator = RegressionEvaluator(predictionCol="y__output", labelCol="y", metricName="rmse")
    cv = CrossValidator(
        estimator=estimator, estimatorParamMaps=grid, evaluator=evaluator, numFolds=2, seed=3
    )
    cv.fit(frame)
    store = Store.create(store_path)
    runs = sorted(os.listdir(store.get_runs_path()))
    assert len(runs) == 5, runs  # 2 grid points x 2 folds, and the final refit on all rows
    for run in runs:  # each trained its epoch: none resumed another's finished run
        assert len(store.read_json(store.get_history_path(run))) == 1, run
