"""ringcore.data: both Parquet readers on real files (pyarrow-written), real petastorm."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from ringcore.data import make_reader, parquet_row_counts, read_shard, resolve_reader

COLUMNS = ["id", "x", "y"]


def _table(ids: np.ndarray) -> pa.Table:
    x = np.stack([ids, ids + 0.25, ids + 0.5], axis=1).astype(np.float32)
    return pa.table(
        {
            "id": pa.array(ids, type=pa.int64()),
            "x": pa.array(list(x), type=pa.list_(pa.float32())),
            "y": pa.array(ids * 2.0, type=pa.float64()),
            "unused": pa.array([str(i) for i in ids]),
        }
    )


def _write(path, sizes: list[int], row_group_size: int | None = None) -> str:
    path.mkdir()
    start = 0
    for i, n in enumerate(sizes):
        ids = np.arange(start, start + n)
        pq.write_table(
            _table(ids), path / f"part-{i:05d}.parquet", row_group_size=row_group_size or max(n, 1)
        )
        start += n
    return str(path)


@pytest.fixture
def ragged_dir(tmp_path):
    """Unbalanced files with several row groups each: 103 rows."""
    return _write(tmp_path / "ragged", [37, 5, 61], row_group_size=16)


@pytest.fixture
def balanced_dir(tmp_path):
    """One file per rank, one row group per file: 2 x 50 rows."""
    return _write(tmp_path / "balanced", [50, 50])


def _epoch(path, rank, size, batch_size, reader, **kw):
    with make_reader(
        path,
        rank=rank,
        size=size,
        batch_size=batch_size,
        columns=COLUMNS,
        reader=reader,
        num_epochs=1,
        **kw,
    ) as r:
        return list(r)


def test_arrow_reader_gives_every_rank_the_same_number_of_exact_batches(ragged_dir):
    per_rank = [_epoch(ragged_dir, rank, 2, 8, "arrow") for rank in range(2)]
    assert [len(b) for b in per_rank] == [6, 6]  # 103 // 2 = 51 rows each → 6 batches of 8
    for batch in itertools.chain(*per_rank):
        assert set(batch) == set(COLUMNS)
        assert batch["id"].shape == (8,)
        assert batch["x"].shape == (8, 3) and batch["x"].dtype == np.float32
        np.testing.assert_allclose(batch["x"][:, 1], batch["id"] + 0.25)
        np.testing.assert_allclose(batch["y"], batch["id"] * 2.0)


def test_arrow_reader_sees_every_row_once_per_epoch_within_the_drop_last_remainder(ragged_dir):
    size, batch_size = 3, 5
    seen = [
        np.concatenate([b["id"] for b in _epoch(ragged_dir, r, size, batch_size, "arrow")])
        for r in range(size)
    ]
    ids = np.concatenate(seen)
    assert len(ids) == len(set(ids.tolist()))  # no row twice
    per_rank = 103 // size
    assert len(ids) == size * (per_rank // batch_size) * batch_size
    for r, rank_ids in enumerate(seen):  # rank r reads rows [r * per_rank, (r + 1) * per_rank)
        assert rank_ids.min() >= r * per_rank and rank_ids.max() < (r + 1) * per_rank


def test_arrow_reader_shuffles_reproducibly_and_keeps_the_rows(ragged_dir):
    plain = np.concatenate([b["id"] for b in _epoch(ragged_dir, 0, 1, 1, "arrow")])
    first = np.concatenate(
        [b["id"] for b in _epoch(ragged_dir, 0, 1, 1, "arrow", shuffle=True, seed=3)]
    )
    again = np.concatenate(
        [b["id"] for b in _epoch(ragged_dir, 0, 1, 1, "arrow", shuffle=True, seed=3)]
    )
    assert sorted(first.tolist()) == plain.tolist()
    assert not np.array_equal(first, plain)
    np.testing.assert_array_equal(first, again)


def test_reader_without_num_epochs_runs_past_one_epoch(balanced_dir):
    for reader in ("arrow", "petastorm"):
        with make_reader(
            balanced_dir, rank=1, size=2, batch_size=20, columns=["id"], reader=reader
        ) as r:
            batches = list(itertools.islice(r, 7))  # 140 rows from a 50-row shard
        assert all(b["id"].shape == (20,) for b in batches)
        assert set(np.concatenate([b["id"] for b in batches]).tolist()) == set(range(50, 100))


def test_petastorm_reader_on_balanced_files_gives_equal_exact_batches(balanced_dir):
    per_rank = [_epoch("file://" + balanced_dir, rank, 2, 16, "petastorm") for rank in range(2)]
    assert [len(b) for b in per_rank] == [3, 3]  # 50 // 16
    ids = [set(np.concatenate([b["id"] for b in batches]).tolist()) for batches in per_rank]
    assert ids[0].isdisjoint(ids[1])
    assert len(ids[0]) == len(ids[1]) == 48
    for batch in itertools.chain(*per_rank):
        assert batch["x"].shape == (16, 3) and batch["x"].dtype == np.float32
        assert batch["id"].shape == (16,)
        np.testing.assert_allclose(batch["x"][:, 2], batch["id"] + 0.5)


def test_petastorm_reader_shuffle_keeps_the_rows(balanced_dir):
    batches = _epoch(balanced_dir, 0, 2, 10, "petastorm", shuffle=True, seed=1)
    ids = np.concatenate([b["id"] for b in batches])
    assert sorted(ids.tolist()) == list(range(50))
    assert not np.array_equal(ids, np.arange(50))


def test_read_shard_arrow_covers_every_row_split_within_one_row(ragged_dir):
    shards = [
        read_shard(ragged_dir, rank=r, size=2, columns=COLUMNS, reader="arrow") for r in range(2)
    ]
    assert [len(s["id"]) for s in shards] == [51, 52]
    assert sorted(np.concatenate([s["id"] for s in shards]).tolist()) == list(range(103))
    assert shards[1]["x"].shape == (52, 3)


def test_read_shard_petastorm_gives_each_rank_its_row_groups(balanced_dir):
    shards = [
        read_shard(balanced_dir, rank=r, size=2, columns=["id", "x"], reader="petastorm")
        for r in range(2)
    ]
    assert [len(s["id"]) for s in shards] == [50, 50]
    assert sorted(np.concatenate([s["id"] for s in shards]).tolist()) == list(range(100))
    assert shards[0]["x"].shape == (50, 3)


def test_parquet_row_counts_reads_each_file(ragged_dir):
    assert parquet_row_counts(ragged_dir) == [37, 5, 61]
    assert parquet_row_counts("file://" + ragged_dir) == [37, 5, 61]


def test_petastorm_with_fewer_row_groups_than_ranks_says_what_to_do(balanced_dir):
    with pytest.raises(ValueError, match="fewer row groups than the 3 ranks"):
        make_reader(balanced_dir, rank=2, size=3, batch_size=4, columns=["id"], reader="petastorm")


def test_arrays_of_different_lengths_are_refused_with_the_column_name(tmp_path):
    tmp_path.joinpath("ragged_arrays").mkdir()
    table = pa.table({"v": pa.array([[1.0, 2.0], [3.0]], type=pa.list_(pa.float32()))})
    pq.write_table(table, tmp_path / "ragged_arrays" / "part-0.parquet")
    with pytest.raises(ValueError, match="column 'v' holds arrays of different lengths"):
        read_shard(tmp_path / "ragged_arrays", rank=0, size=1, columns=["v"], reader="arrow")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"reader": "csv"}, "reader must be one of"),
        ({"batch_size": 0}, "batch_size must be >= 1"),
        ({"rank": 2}, "need 0 <= rank < size"),
        ({"num_epochs": 0}, "num_epochs must be >= 1"),
        ({"pool_type": "fork"}, r"reader_pool_type must be one of 'thread', 'process', 'dummy'"),
        ({"workers_count": 0}, "workers_count must be >= 1; got 0"),
        ({"pool_type": "process"}, r"'process' is petastorm's process pool.*'thread'.*'dummy'"),
    ],
)
def test_bad_reader_arguments_are_refused(balanced_dir, kwargs, message):
    args = {"rank": 0, "size": 2, "batch_size": 4, "columns": ["id"], "reader": "arrow", **kwargs}
    with pytest.raises(ValueError, match=message):
        make_reader(balanced_dir, **args)


def test_auto_picks_petastorm_when_installed():
    assert resolve_reader("auto") == "petastorm"
    assert resolve_reader("arrow") == "arrow"


def _ids(batches) -> list[int]:
    return sorted(int(i) for b in batches for i in b["id"])


@pytest.mark.parametrize(
    ("reader", "pool_type", "workers"),
    [
        ("arrow", "thread", 1),
        ("arrow", "thread", 3),
        ("arrow", "dummy", 1),
        ("petastorm", "thread", 2),
        ("petastorm", "dummy", 1),
        ("petastorm", "process", 2),
    ],
)
def test_every_reader_pool_reads_the_same_rows_of_each_rank(ragged_dir, reader, pool_type, workers):
    if reader == "petastorm":  # petastorm shards by row group: files of 16-row groups
        ragged_dir = _write(Path(ragged_dir).parent / "groups", [32, 32, 32, 32], 16)
    for rank in range(2):
        inline = _epoch(ragged_dir, rank, 2, 8, reader, pool_type="dummy")
        pooled = _epoch(ragged_dir, rank, 2, 8, reader, pool_type=pool_type, workers_count=workers)
        assert _ids(pooled) == _ids(inline) and len(pooled) == len(inline) > 0


def _reader_threads() -> int:
    return sum(t.name.startswith("ringtrain-reader") for t in threading.enumerate())


def test_the_arrow_reader_reads_ahead_in_threads_and_stops_them_when_closed(ragged_dir):
    before = _reader_threads()
    with make_reader(
        ragged_dir, rank=0, size=1, batch_size=4, columns=["id"], reader="arrow",
        workers_count=2, pool_type="thread",
    ) as reader:  # fmt: skip
        first = next(reader)  # endless (num_epochs=None): closed mid-epoch
        assert _reader_threads() - before == 2
    assert _reader_threads() == before and first["id"].tolist() == [0, 1, 2, 3]
    with make_reader(
        ragged_dir, rank=0, size=1, batch_size=4, columns=["id"], reader="arrow", pool_type="dummy"
    ) as reader:
        next(reader)
        assert _reader_threads() == before  # inline: no thread at all


def test_remote_reads_turn_off_fsspecs_read_ahead_cache_unless_asked():
    """A filesystem class taking ``default_cache_type`` (as s3fs, gcsfs and adlfs do;
    registered here, so that every tested stack has one) gets "none" unless chosen."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    from ringcore.data._sources import read_options as _read_options

    class Cached(MemoryFileSystem):
        def __init__(self, *args, default_cache_type="readahead", **kwargs):
            super().__init__(*args, **kwargs)

    fsspec.register_implementation("ringcached", Cached, clobber=True)
    assert _read_options("ringcached://bucket/data", {"key": "k"}) == {
        "key": "k",
        "default_cache_type": "none",
    }
    chosen = {"default_cache_type": "readahead", "default_block_size": 2**20}
    assert _read_options("ringcached://bucket/data", chosen) == chosen
    assert _read_options("/local/path", None) == {}
    assert _read_options("memory://x", None) == {}  # a filesystem without that option
