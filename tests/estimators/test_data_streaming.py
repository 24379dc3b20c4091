"""Workers read their own row groups straight from the store, streamed (issue 23):
through fsspec from a real S3 API (moto's server on 127.0.0.1), without a local copy,
validation batch by batch; a fit on ``s3://`` writes its Parquet from the executors'
Python workers (no hadoop-aws jars here) and keeps its run in the bucket."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from _servers import moto_s3_server

import spark_runner
from estimators import Callback, FsspecStore, RingEstimator, Store
from estimators.data._parquet_writer import pick_writer
from estimators.data._readers import ValidationShard
from ringcore.data import make_reader

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUCKET = "ringtrain-test"
GROUP_ROWS = [30, 30, 20]  # per file: three row groups


@pytest.fixture(scope="module")
def s3():
    """storage_options of a real S3 API on 127.0.0.1, with the bucket made."""
    import s3fs

    with moto_s3_server() as options:
        s3fs.S3FileSystem(**options).mkdir(BUCKET)
        yield options


@pytest.fixture(scope="module")
def dataset(s3):
    """Two Parquet files of three row groups each in the bucket: ``id`` numbers rows."""
    import s3fs

    fs = s3fs.S3FileSystem(**s3)
    start = 0
    for part in range(2):
        rows = sum(GROUP_ROWS)
        table = pa.table({"id": np.arange(start, start + rows), "x": np.ones(rows)})
        with fs.open(f"{BUCKET}/data/part-{part}.parquet", "wb") as f:
            writer = pq.ParquetWriter(f, table.schema)
            offset = 0
            for n in GROUP_ROWS:
                writer.write_table(table.slice(offset, n))
                offset += n
            writer.close()
        start += rows
    return f"s3://{BUCKET}/data"


def test_each_rank_reads_only_its_own_row_groups_from_s3_in_place(dataset, s3):
    per_file = sum(GROUP_ROWS)
    for rank in range(2):  # arrow: rows split evenly, here one whole file per rank
        with make_reader(dataset, rank=rank, size=2, batch_size=16, columns=["id"],
                         reader="arrow", num_epochs=1, storage_options=s3) as reader:  # fmt: skip
            ids = np.concatenate([b["id"] for b in reader])
        assert reader.files == [f"{BUCKET}/data/part-{rank}.parquet"]
        assert reader.rows_read == per_file  # its own rows only, never the other file's
        assert set(ids) <= set(range(rank * per_file, (rank + 1) * per_file))
    groups = GROUP_ROWS * 2  # petastorm: row group i to rank i % 2
    seen = []
    for rank in range(2):
        with make_reader(dataset, rank=rank, size=2, batch_size=10, columns=["id"],
                         reader="petastorm", num_epochs=1, storage_options=s3) as reader:  # fmt: skip
            seen.append(np.concatenate([b["id"] for b in reader]))
        assert reader.rows_read == sum(groups[rank::2])
    assert not set(seen[0]) & set(seen[1])  # disjoint row groups
    assert sorted(np.concatenate(seen)) == list(range(2 * per_file))  # together: all


@pytest.mark.parametrize("reader", ["arrow", "petastorm"])
def test_validation_is_streamed_batch_by_batch_never_held_whole(dataset, s3, reader):
    store = FsspecStore(f"s3://{BUCKET}", s3)
    shard = ValidationShard(store, dataset, rank=1, size=2, columns=["id", "x"],
                            reader=reader, batch_size=7)  # fmt: skip
    sizes = [len(b["id"]) for b in shard]
    expected_rows = sum(GROUP_ROWS) if reader == "arrow" else sum((GROUP_ROWS * 2)[1::2])
    assert shard.rows == expected_rows == sum(sizes)  # every row of the shard, once
    assert max(sizes) == 7 and shard.batches_read == len(sizes) == -(-expected_rows // 7)
    assert len(shard) == len(sizes)
    limited = ValidationShard(store, dataset, rank=1, size=2, columns=["id"],
                              reader=reader, batch_size=7, steps=3)  # fmt: skip
    assert [len(b["id"]) for b in limited] == [7, 7, 7] and limited.rows_read == 21


@pytest.fixture(scope="module")
def spark(tmp_path_factory):
    tmpdir = str(tmp_path_factory.mktemp("worker-tmp"))
    session = spark_runner.local_session(
        "local[2]",
        app_name="test-data-streaming",
        conf={"spark.sql.shuffle.partitions": "2", "spark.executorEnv.TMPDIR": tmpdir},
    )
    try:
        session.sparkContext.setLogLevel("FATAL")
        yield session, tmpdir
    finally:
        session.stop()


def _no_local_copy() -> Callback:
    """A callback failing the fit when a copy of the data (``ringtrain-data-*``) is in
    the worker's TMPDIR (made in a function: it travels to the workers by value)."""

    class NoLocalCopy(Callback):
        def on_batch_end(self, batch, logs):
            import os
            import tempfile

            folder = tempfile.gettempdir()
            copies = [n for n in os.listdir(folder) if n.startswith("ringtrain-data-")]
            assert not copies, f"a local copy of the data in {folder}: {copies}"

    return NoLocalCopy()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_fit_on_s3_reads_in_place_and_keeps_model_checkpoints_and_history_in_the_bucket(
    spark, s3
):
    import s3fs

    session, tmpdir = spark
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(96, 4))
    rows = [(x.tolist(), float(x.sum())) for x in xs]
    df = session.createDataFrame(rows, ["x", "y"])
    store = Store.create(f"s3://{BUCKET}/fit", s3)
    assert pick_writer(session, store) == "arrow"  # no s3a jars here, and storage_options
    model = torch.nn.Linear(4, 1)
    estimator = RingEstimator(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.05),
        loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"], batch_size=8,
        epochs=2, num_proc=2, validation=0.25, store=store, run_id="s3run",
        callbacks=[_no_local_copy()], verbose=0,
    )  # fmt: skip
    fitted = estimator.fit(df)
    fs = s3fs.S3FileSystem(**s3)
    fs.invalidate_cache()
    run = f"{BUCKET}/fit/runs/s3run"
    # the newest claim's writer folder holds the checkpoint on an object store
    found = store.find_checkpoint("s3run")
    assert found is not None and found.startswith(f"s3://{run}/checkpoint/writer-"), found
    assert fs.exists(found)
    history = json.loads(fs.cat_file(f"{run}/logs/history.json"))
    assert [e["epoch"] for e in history] == [1, 2] and "val_loss" in history[-1]
    data = sorted(p for p in fs.find(f"{BUCKET}/fit") if "intermediate_train_data" in p)
    assert [p.rsplit("/", 1)[1] for p in data] == ["part-00000.parquet", "part-00001.parquet"]
    assert not [n for n in os.listdir(tmpdir) if n.startswith("ringtrain-data-")]
    predicted = fitted.transform(df).collect()
    assert len(predicted) == 96 and all(np.isfinite(r[-1][0] if isinstance(r[-1], list)
                                                    else r[-1]) for r in predicted)  # fmt: skip


@pytest.mark.spark
def test_parquet_writer_spark_is_refused_before_any_job_where_hadoop_lacks_the_scheme(spark, s3):
    session, _ = spark
    store = FsspecStore(f"s3://{BUCKET}/refused", s3, parquet_writer="spark")
    with pytest.raises(ValueError) as err:
        pick_writer(session, store)
    message = str(err.value)
    assert "Spark cannot write s3a://" in message and "hadoop-aws" in message
    assert "parquet_writer='arrow'" in message
    assert pick_writer(session, Store.create(str(ROOT))) == "spark"
    with pytest.raises(ValueError, match="parquet_writer='nope' is not one of"):
        FsspecStore(f"s3://{BUCKET}/x", s3, parquet_writer="nope")


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_bench_data_rss_measures_both_stores_and_writes_its_table_and_json(spark, s3, tmp_path):
    """bench/data_rss.py's method on this module's session and S3 server (no second
    Spark start): one tiny size and one round (the script itself takes two sizes and
    refuses fewer than 5 rounds: this checks the code, not a figure), to keep the
    suite's time: 8 fits."""
    sys.path.insert(0, os.path.join(ROOT, "bench"))
    try:
        import data_rss
    finally:
        sys.path.remove(os.path.join(ROOT, "bench"))
    session, _ = spark
    sizes, env = [4_000], data_rss._common.environment()
    runs = data_rss.measure(session, s3, sizes, rounds=1, batch_size=128)
    body = data_rss.report(tmp_path, env, runs, sizes, 1, quick=True)
    written = json.loads((tmp_path / "data_rss.json").read_text())
    assert written["benchmark"] == "data_rss" and written["targets"] == body["targets"]
    assert {(r["store"], r["rows"], r["files"]) for r in written["runs"] if r["cold"]} == {
        (s, n, 1) for s in ("local", "s3") for n in sizes
    } | {("local", sizes[-1], 10), ("s3", sizes[-1], 10)}
    assert sum(not r["cold"] for r in written["runs"]) == 4  # 1 round x 2 stores x 2 layouts
    files = {row[2] for row in written["table"]["rows"]}
    assert files == {"2", "20"}  # partitions_per_process 1 and 10 on 2 workers
    assert all(r["peak_rss_mib"] > 0 and r["fit_s"] > 0 for r in written["runs"])
    assert [t["target"] for t in written["targets"]] == ["rss_flat", "remote_wall_time"]
    assert all(isinstance(t["met"], bool) for t in written["targets"])
    assert written["checks_passed"], written["checks"]
