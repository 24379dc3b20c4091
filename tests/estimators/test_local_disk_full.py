"""A worker's local disk full while it copies the training data from a remote store: a
tiny tmpfs (root mounts it; skipped with the reason elsewhere) is the workers' TMPDIR.
Workers copy only for a store made with ``local_copy=True`` (else they read in place,
streamed: tests/estimators/test_data_streaming.py). The copy fails with an error that names the
local disk, the sizes and the fix — not the store, which is fine — and leaves nothing
on the small disk."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from _reliability import record

from estimators import FsspecStore
from estimators.store import LocalDiskFullError

SMALL_DISK = 128 * 1024  # bytes: the training data below is several times this


@contextlib.contextmanager
def _small_disk(path: str):
    os.makedirs(path, exist_ok=True)
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs as the workers' local disk needs root")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SMALL_DISK}", "ringtrain-test", path],
        capture_output=True, text=True,
    )  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", path], check=False)


def _write_data(folder: str, rows: int = 4000) -> str:
    rng = np.random.default_rng(0)
    table = pa.table({"x": list(rng.normal(size=(rows, 16))), "y": rng.integers(0, 2, rows)})
    path = os.path.join(folder, "intermediate_train_data.0")
    os.makedirs(path)
    pq.write_table(table, os.path.join(path, "part-0.parquet"))
    return path


@pytest.mark.reliability(fault="a worker's local disk full (copying data from the store)", category="fault", cases=2)  # fmt: skip
def test_copying_data_onto_a_full_local_disk_names_it_and_leaves_nothing(tmp_path, monkeypatch):
    store = FsspecStore("file://" + str(tmp_path / "store"))
    data = _write_data(str(tmp_path / "store"))
    assert os.path.getsize(os.path.join(data, "part-0.parquet")) > 2 * SMALL_DISK
    with _small_disk(str(tmp_path / "small")) as small:
        monkeypatch.setattr(tempfile, "tempdir", small)
        with pytest.raises(LocalDiskFullError) as err:
            store.localize(data)
        message = str(err.value)
        assert "this worker's local disk is full" in message and small in message
        assert "bytes free" in message and "The store is fine" in message
        assert "spark.executorEnv.TMPDIR" in message
        assert os.listdir(small) == []  # the partial copy is gone
        monkeypatch.setattr(tempfile, "tempdir", None)
        copy = store.localize(data)  # on a disk with room the same copy works
        assert os.listdir(copy) == ["part-0.parquet"]


_DRIVER = """
import sys, torch
import spark_runner
from estimators import FsspecStore, RingEstimator
from ringcore import WorkerError

spark = spark_runner.local_session(
    "local[2]", app_name="test_local_disk_full", log_level="ERROR",
    conf={"spark.executorEnv.TMPDIR": sys.argv[1]},
)
try:
    import numpy as np
    x = np.random.default_rng(0).normal(size=(4000, 16))  # ~0.5 MB of Parquet: no room
    rows = [(r.tolist(), i % 2) for i, r in enumerate(x)]
    df = spark.createDataFrame(rows, ["x", "y"])
    model = torch.nn.Linear(16, 2)
    estimator = RingEstimator(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["x"], label_cols=["y"],
        batch_size=64, epochs=1, num_proc=2, reader="arrow", verbose=0,
        store=FsspecStore("file://" + sys.argv[2], local_copy=True), run_id="diskfull",
    )
    try:
        estimator.fit(df)
    except WorkerError as err:
        print("WORKERERROR", err.error_type, "|", err.message.replace(chr(10), " "))
    else:
        print("NO ERROR")
finally:
    spark.stop()
"""


@pytest.mark.spark
@pytest.mark.reliability(fault="a worker's local disk full (copying data from the store)", category="fault", cases=2)  # fmt: skip
@pytest.mark.timeout(300)
def test_a_fit_whose_workers_local_disk_is_full_fails_naming_it_not_the_store(tmp_path, request):
    store_dir = str(tmp_path / "store")
    with _small_disk(str(tmp_path / "small")) as small:
        proc = subprocess.run(
            [sys.executable, "-c", _DRIVER, small, store_dir],
            capture_output=True, text=True, timeout=280,
        )  # fmt: skip
        left = os.listdir(small)
    out = proc.stdout
    assert proc.returncode == 0 and "WORKERERROR" in out, out[-3000:] + proc.stderr[-3000:]
    kind, message = out.split("WORKERERROR", 1)[1].split("|", 1)
    assert kind.strip() == "LocalDiskFullError", out
    assert "local disk is full" in message and small in message
    assert "could not write to the store" not in message  # not blamed on the store
    # none of our copies left on the small disk (torch makes its torchinductor_<user>
    # cache folder in TMPDIR as it is imported: not ours, and empty)
    assert [name for name in left if not name.startswith("torchinductor_")] == [], left
    store = FsspecStore("file://" + store_dir)
    assert store.find_checkpoint("diskfull") is None  # no epoch ran: no checkpoint at all
    record(request, note="LocalDiskFullError naming TMPDIR; no copy left on the small disk")
