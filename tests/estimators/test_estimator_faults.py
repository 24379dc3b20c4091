"""Faults injected into a running ``RingEstimator.fit`` on a real ``local-cluster[2,1,1024]``
(two executor JVMs, children of this process's driver JVM, with Spark task retries on):

- an executor JVM SIGKILLed mid-fit: Spark reruns the barrier stage, the fit resumes from
  the last checkpoint and ends with the model of an uninterrupted run, each epoch once;
- the driver interrupted (Ctrl-C, or the job cancelled): every worker process is gone
  within seconds (by PID) and the store holds only complete checkpoints;
- the store's disk full, or the store read-only, mid-fit: a clear error that names the
  store, and the earlier checkpoint intact.

The workers are made to wait at a known point by their ``transformation_fn`` (user code
that polls a file), so each fault lands mid-fit without any timing guess.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import signal
import subprocess
import threading
import time

import numpy as np
import psutil
import pytest
import torch
from _reliability import record

import spark_runner
from estimators import Callback, RingEstimator, Store
from ringcore import RingError, WorkerError

pytestmark = [pytest.mark.spark, pytest.mark.slow]

EPOCHS = 4
ROWS = 64


@pytest.fixture(scope="module")
def cluster():
    session = spark_runner.local_session(
        "local-cluster[2,1,1024]",
        app_name="test_estimator_faults",
        conf={
            "spark.task.maxFailures": "4",  # retries on: the barrier stage may be rerun
            "spark.stage.maxConsecutiveAttempts": "2",  # ... once, to keep failures short
            "spark.executor.cores": "1",
            "spark.executor.memory": "512m",
            "spark.sql.shuffle.partitions": "2",
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="module")
def frame(cluster):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(ROWS, 4))
    rows = [([float(v) for v in r], int(r.sum() > 0)) for r in x]
    return cluster.createDataFrame(rows, ["x", "y"])


def _pausing(history_path: str, marks: str, after_epochs: int, every_rank: bool, hold_s: float):
    """A ``transformation_fn`` that, once ``after_epochs`` epochs are in the history, writes
    its PID under ``marks`` and waits (up to ``hold_s``, or until ``marks/go`` exists) —
    once per worker process (``every_rank``) or once for the whole run."""

    def transform(batch):
        if every_rank:  # this worker's PID, once, whether or not it pauses
            with contextlib.suppress(FileExistsError):
                seen = os.open(
                    os.path.join(marks, f"seen-{os.getpid()}"),
                    os.O_CREAT | os.O_EXCL | os.O_WRONLY,
                )
                os.write(seen, str(os.getpid()).encode())
                os.close(seen)
        try:
            with open(history_path) as f:
                done = len(json.load(f))
        except (OSError, ValueError):
            done = 0
        if done < after_epochs:
            return batch
        name = f"paused-{os.getpid()}" if every_rank else "paused"
        try:
            fd = os.open(os.path.join(marks, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return batch
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        deadline = time.monotonic() + hold_s
        while time.monotonic() < deadline and not os.path.exists(os.path.join(marks, "go")):
            time.sleep(0.05)
        return batch

    return transform


def _estimator(store: Store, run_id: str, **overrides) -> RingEstimator:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    params = {
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.5),
        "loss": torch.nn.CrossEntropyLoss(),
        "feature_cols": ["x"],
        "label_cols": ["y"],
        "batch_size": 8,
        "epochs": EPOCHS,
        "num_proc": 2,
        "reader": "arrow",
        "verbose": 0,
        "random_seed": 7,
        "store": store,
        "run_id": run_id,
    }
    params.update(overrides)
    return RingEstimator(**params)


def _paused_pids(
    marks: str, count: int, timeout: float, failed: list, prefix: str = "paused"
) -> list[int]:
    """The PIDs of the first ``count`` workers that wrote a ``prefix`` mark."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not failed:
        names = [n for n in os.listdir(marks) if n.startswith(prefix)]
        if len(names) >= count:
            pids = []
            for n in names:
                with open(os.path.join(marks, n)) as f:
                    text = f.read()
                if text:
                    pids.append(int(text))
            if len(pids) >= count:
                return pids
        time.sleep(0.1)
    raise AssertionError(f"the workers did not pause within {timeout} s ({failed})")


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _gone_within(pids: list[int], timeout: float) -> float:
    started = time.monotonic()
    while any(_alive(p) for p in pids) and time.monotonic() - started < timeout:
        time.sleep(0.1)
    assert not [p for p in pids if _alive(p)], f"worker processes {pids} outlived the fit"
    return time.monotonic() - started


def _executor_of(pid: int) -> psutil.Process:
    """The executor JVM that ``pid`` (a Python worker) runs under — one of this test
    process's own descendants, never anybody else's JVM."""
    mine = {p.pid for p in psutil.Process().children(recursive=True)}
    for parent in psutil.Process(pid).parents():
        with contextlib.suppress(psutil.Error):
            if "CoarseGrainedExecutorBackend" in " ".join(parent.cmdline()):
                assert parent.pid in mine, "the executor is not a child of this test's driver"
                return parent
    raise AssertionError(f"no executor JVM above worker {pid}")


def _start_recorder(marks: str) -> Callback:
    """A callback that writes, per rank and Spark stage attempt, the ``start_epoch`` the
    fit itself reports in ``on_train_begin`` (0-based: the epochs already done), so the
    test reads where the retried attempt started from the fit, not from a guess."""

    class StartRecorder(Callback):
        def on_train_begin(self, logs):
            attempt = os.environ.get(spark_runner.ATTEMPT_ENV_VAR, "0")
            name = f"begin-rank{self.rank}-attempt{attempt}-pid{os.getpid()}"
            with open(os.path.join(marks, name), "w") as f:
                f.write(str(logs["start_epoch"]))

    return StartRecorder()


def _starts(marks: str) -> dict[str, int]:
    """``{"begin-rank<r>-attempt<a>-pid<p>": start_epoch}`` as :func:`_start_recorder` wrote it."""
    starts = {}
    for name in os.listdir(marks):
        if name.startswith("begin-"):
            with open(os.path.join(marks, name)) as f:
                starts[name] = int(f.read())
    return starts


def _checkpoint(store: Store, run_id: str) -> dict:
    return torch.load(store.get_checkpoint_path(run_id), weights_only=True)


def _temporaries(root: str) -> list[str]:
    return [os.path.join(d, f) for d, _, names in os.walk(root) for f in names if ".tmp-" in f]


# --- an executor JVM killed ---------------------------------------------------------------------


@pytest.mark.reliability(fault="an executor JVM SIGKILLed mid-fit (Spark)", category="fault")
@pytest.mark.timeout(420)
def test_an_executor_jvm_killed_mid_fit_resumes_to_the_uninterrupted_model(
    cluster, frame, tmp_path, request
):
    store = Store.create(str(tmp_path / "store"))
    reference = _estimator(store, "reference").fit(frame)  # the same prepared data, below
    marks = str(tmp_path / "marks")
    os.makedirs(marks)
    pause = _pausing(store.get_history_path("killed"), marks, 2, every_rank=False, hold_s=120)
    estimator = _estimator(
        store, "killed", transformation_fn=pause, callbacks=[_start_recorder(marks)]
    )
    killed: dict = {}
    failed: list = []

    def kill_one_executor():
        try:
            worker = _paused_pids(marks, 1, 240, failed)[0]
            executor = _executor_of(worker)
            # the last checkpoint before the kill: the paused rank holds up the epoch after it
            done = _checkpoint(store, "killed")["epoch"]
            killed.update(pid=executor.pid, worker=worker, at=time.monotonic(), checkpointed=done)
            executor.send_signal(signal.SIGKILL)
        except BaseException as exc:
            failed.append(exc)

    killer = threading.Thread(target=kill_one_executor, daemon=True)
    killer.start()
    try:
        model = estimator.fit(frame)
    finally:
        failed.append("fit returned")
        killer.join(10)
    recovered = time.monotonic() - killed["at"]
    assert not _alive(killed["pid"]) and not _alive(killed["worker"])
    checkpointed = killed["checkpointed"]
    assert checkpointed == 2, killed  # the pause is after epoch 2's checkpoint, before epoch 3's
    # where each attempt started, as the fit reported it: the first from scratch, every rank
    # of the retried attempt(s) at the epoch after the last checkpoint (0-based start_epoch =
    # epochs done, so 1-based it starts at checkpointed + 1)
    starts = _starts(marks)
    first = {n: e for n, e in starts.items() if "-attempt0-" in n}
    retried = {n: e for n, e in starts.items() if "-attempt0-" not in n}
    assert sorted(first.values()) == [0, 0], starts
    assert retried and sorted({n.split("-")[1] for n in retried}) == ["rank0", "rank1"], starts
    assert set(retried.values()) == {checkpointed}, starts
    history = model.getHistory()
    assert [e["epoch"] for e in history] == list(range(1, EPOCHS + 1))
    assert _checkpoint(store, "killed")["epoch"] == EPOCHS
    for name, value in reference.getModel().state_dict().items():
        torch.testing.assert_close(model.getModel().state_dict()[name], value, atol=1e-5, rtol=1e-4)
    assert history[-1]["train_loss"] == pytest.approx(
        reference.getHistory()[-1]["train_loss"], rel=1e-4
    )
    resumed_at = checkpointed + 1
    record(request, recover_s=recovered, note=f"resumed at epoch {resumed_at} of {EPOCHS}")


# --- the driver interrupted ----------------------------------------------------------------------


@pytest.mark.reliability(
    fault="the driver interrupted mid-fit (Ctrl-C, job cancel)", category="fault"
)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["ctrl-c", "job-cancel"])
def test_an_interrupted_fit_ends_every_worker_and_leaves_only_whole_checkpoints(
    cluster, frame, tmp_path, how, request
):
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    store = Store.create(str(tmp_path / "store"))
    marks = str(tmp_path / "marks")
    os.makedirs(marks)
    pause = _pausing(store.get_history_path("cut"), marks, 1, every_rank=True, hold_s=120)
    estimator = _estimator(store, "cut", transformation_fn=pause)
    pids: list[int] = []
    failed: list = []
    interrupted: list[float] = []

    def interrupt():
        try:
            # One paused rank holds the whole ring (the other waits for it in the next
            # allreduce, or pauses too): interrupt then, with both workers' PIDs known.
            # Waiting for both to pause could take hold_s: a rank that prefetched its
            # batch before the epoch's history was written never pauses in time.
            _paused_pids(marks, 1, 240, failed)
            # (the driver runs transformation_fn once too, checking it before the job)
            for pid in _paused_pids(marks, 3, 240, failed, prefix="seen-"):
                if pid != os.getpid():
                    pids.append(pid)
            interrupted.append(time.monotonic())
            if how == "ctrl-c":
                signal.pthread_kill(main, signal.SIGINT)
            else:
                cluster.sparkContext.cancelAllJobs()
        except BaseException as exc:
            failed.append(exc)

    helper = threading.Thread(target=interrupt, daemon=True)
    helper.start()
    expected = KeyboardInterrupt if how == "ctrl-c" else RingError
    try:
        with pytest.raises(expected) as info:
            estimator.fit(frame)
    finally:
        failed.append("fit returned")
        helper.join(10)
    if how == "job-cancel":
        assert "cancel" in str(info.value).lower()
    assert len(pids) == 2
    gone = _gone_within(pids, 20)
    assert _temporaries(store.prefix_path) == []
    checkpoint = _checkpoint(store, "cut")  # whole: it loads, and matches the history
    assert checkpoint["epoch"] == 1
    assert store.read_json(store.get_history_path("cut")) == checkpoint["history"]
    record(request, detect_s=time.monotonic() - interrupted[0], note=f"workers gone {gone:.1f} s")


# --- the store fails mid-fit --------------------------------------------------------------------


def _chattr(flag: str, path: str) -> None:
    subprocess.run(["chattr", flag, path], check=True, capture_output=True)


def _fill(directory: str) -> None:
    """Write zeros under ``directory`` until its filesystem says ENOSPC."""
    chunk = b"\0" * (1 << 20)
    with open(os.path.join(directory, "filler"), "wb") as f:
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
    with contextlib.suppress(OSError):
        while True:  # the last pages, a byte at a time
            with open(os.path.join(directory, f"filler-{time.monotonic_ns()}"), "wb") as g:
                g.write(b"\0" * 4096)


@contextlib.contextmanager
def _small_tmpfs(path: str):
    """A 16 MiB tmpfs at ``path``: a real filesystem that fills up. Needs root and
    CAP_SYS_ADMIN (containers may forbid it): skipped, saying why, without them."""
    os.makedirs(path)
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("a size-limited tmpfs needs root (mount); not root here")
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", path], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a size-limited tmpfs here: {done.stderr.strip()}")
    try:
        yield path
    finally:
        if subprocess.run(["umount", path], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", path], capture_output=True)


@contextlib.contextmanager
def _read_only(path: str):
    """Make the directory ``path`` refuse new files: chmod for a normal user; as root
    (chmod does not stop root) the immutable attribute (chattr +i)."""
    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield "Permission denied"
        finally:
            os.chmod(path, 0o755)
        return
    if shutil.which("chattr") is None:
        pytest.skip("running as root without chattr: no way to make a directory read-only")
    try:
        _chattr("+i", path)
    except subprocess.CalledProcessError as exc:
        pytest.skip(f"chattr +i is not allowed here: {exc.stderr.decode().strip()}")
    try:
        yield "Operation not permitted"
    finally:
        _chattr("-i", path)


@pytest.mark.reliability(fault="the store's disk full or read-only mid-fit", category="fault")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("fault", ["disk-full", "read-only"])
def test_a_store_that_stops_taking_writes_fails_clearly_and_keeps_the_last_checkpoint(
    cluster, frame, tmp_path, fault, request
):
    with contextlib.ExitStack() as stack:
        root = str(tmp_path / "store")
        if fault == "disk-full":
            stack.enter_context(_small_tmpfs(root))
        store = Store.create(root)
        marks = str(tmp_path / "marks")
        os.makedirs(marks)
        pause = _pausing(store.get_history_path("full"), marks, 2, every_rank=False, hold_s=120)
        estimator = _estimator(store, "full", transformation_fn=pause)
        failed: list = []
        applied: list[float] = []

        def break_the_store():
            try:
                _paused_pids(marks, 1, 240, failed)
                if fault == "disk-full":
                    _fill(root)
                    reason = "No space left on device"
                else:
                    checkpoints = store.get_checkpoints_path("full")
                    reason = stack.enter_context(_read_only(checkpoints))
                applied.extend([time.monotonic(), reason])
            except BaseException as exc:
                failed.append(exc)
            finally:
                with open(os.path.join(marks, "go"), "w"):
                    pass

        breaker = threading.Thread(target=break_the_store, daemon=True)
        breaker.start()
        try:
            with pytest.raises(WorkerError) as info:
                estimator.fit(frame)
        finally:
            failed.append("fit returned")
            breaker.join(30)
        assert applied, failed
        detected = time.monotonic() - applied[0]
        message = str(info.value)
        for needle in (
            applied[1],  # the value: what the filesystem said
            f"could not write to the store {root}",  # the thing
            "Free space in it or restore write access",  # the fix
            "epoch 2 of 4, is intact",
            "run_id='full' to resume",
        ):
            assert needle in message, f"{needle!r} not in {message}"
        checkpoint = _checkpoint(store, "full")
        assert checkpoint["epoch"] == 2 and [e["epoch"] for e in checkpoint["history"]] == [1, 2]
        assert _temporaries(store.get_checkpoints_path("full")) == []
    record(request, detect_s=detected, note=applied[1])


# --- a zombie attempt writing the run's checkpoint ---------------------------------------------


def _newer_attempt_claims(store: Store, run_id: str, at_epoch: int, marks: str) -> Callback:
    """On rank 0 of stage attempt 0, after epoch ``at_epoch`` (0-based) is checkpointed,
    what a retried attempt does as it starts: claim the run's checkpoints as stage
    attempt 1 of the same fit. From here this attempt is the zombie: it trains on, and its
    next checkpoint must be refused."""

    class Claim(Callback):
        def on_epoch_end(self, epoch, logs):
            attempt = int(os.environ.get(spark_runner.ATTEMPT_ENV_VAR, "0"))
            if self.rank != 0 or attempt != 0 or epoch != at_epoch:
                return
            claim = store.read_json(store.get_writer_path(run_id))
            store.write_json(store.get_writer_path(run_id), {**claim, "attempt": 1})
            # (no test-module function in here: the executors cannot import this module)
            done = len(store.read_json(store.get_history_path(run_id)))
            with open(os.path.join(marks, "claimed"), "w") as f:
                json.dump({"claim": claim, "checkpointed": done}, f)

    return Claim()


@pytest.mark.reliability(
    fault="a zombie task attempt writing the run's checkpoint after a retry took over",
    category="fault",
)
@pytest.mark.timeout(420)
def test_a_zombie_attempt_never_overwrites_the_checkpoint_of_the_attempt_that_took_over(
    cluster, frame, tmp_path, request
):
    store = Store.create(str(tmp_path / "store"))
    marks = str(tmp_path / "marks")
    os.makedirs(marks)
    estimator = _estimator(
        store,
        "zombie",
        callbacks=[_newer_attempt_claims(store, "zombie", 1, marks), _start_recorder(marks)],
    )
    model = estimator.fit(frame)
    with open(os.path.join(marks, "claimed")) as f:
        claimed = json.load(f)
    # attempt 0 had checkpointed epoch 2 when "attempt 1" claimed the run; its epoch-3
    # checkpoint was refused (StaleWriterError failed the stage), Spark reran the stage,
    # and attempt 1 resumed from epoch 2's checkpoint and finished
    assert claimed["checkpointed"] == 2 and claimed["claim"]["attempt"] == 0
    starts = _starts(marks)
    retried = {n: e for n, e in starts.items() if "-attempt0-" not in n}
    assert sorted(e for n, e in starts.items() if "-attempt0-" in n) == [0, 0], starts
    assert retried and set(retried.values()) == {2}, starts
    assert [e["epoch"] for e in model.getHistory()] == list(range(1, EPOCHS + 1))
    assert _checkpoint(store, "zombie")["epoch"] == EPOCHS
    final = store.read_json(store.get_writer_path("zombie"))
    assert final == {"fit": claimed["claim"]["fit"], "attempt": 1}
    reference = _estimator(store, "zombie-reference").fit(frame)
    for name, value in reference.getModel().state_dict().items():
        assert torch.allclose(model.getModel().state_dict()[name], value, atol=1e-5), name
    record(request, note="the zombie's epoch-3 checkpoint refused; attempt 1 resumed at 3")
