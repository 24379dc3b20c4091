"""A rank's shard as batches: the reader's choice and checks, :class:`ShardReader`,
``make_reader``, ``iter_shard`` and ``read_shard`` (``ringcore.data`` exports them)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterable, Iterator, Sequence

import numpy as np

from .. import _stackcheck
from ._arrow import arrow_chunks, arrow_slices
from ._columns import Batch, concat, rebatch
from ._petastorm import open_petastorm, petastorm_chunks
from ._sources import Options, petastorm_url

__all__ = [
    "POOL_TYPES",
    "READERS",
    "ShardReader",
    "iter_shard",
    "make_reader",
    "petastorm_problems",
    "read_shard",
    "resolve_reader",
]

READERS = ("auto", "petastorm", "arrow")
POOL_TYPES = ("thread", "process", "dummy")


def resolve_reader(reader: str) -> str:
    """``"auto"`` → ``"petastorm"`` when it is installed, else ``"arrow"``."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {', '.join(map(repr, READERS))}; got {reader!r}")
    if reader == "auto":
        return "petastorm" if petastorm_problems() == [] else "arrow"
    return reader


def petastorm_problems() -> list[str]:
    """Why petastorm cannot read here (not installed, or the stack check's findings:
    pyarrow >= 15, numpy 2); empty when it can."""
    if importlib.util.find_spec("petastorm") is None:
        return ["petastorm is not installed"]
    return _stackcheck.check()


def check_pool(pool_type: str, workers_count: int, reader: str) -> None:
    if pool_type not in POOL_TYPES:
        raise ValueError(
            f"reader_pool_type must be one of {', '.join(map(repr, POOL_TYPES))}; got {pool_type!r}"
        )
    if workers_count < 1:
        raise ValueError(f"the reader's workers_count must be >= 1; got {workers_count}")
    if pool_type == "process" and reader != "petastorm":
        raise ValueError(
            "reader_pool_type='process' is petastorm's process pool, but this reader is "
            f"{reader!r}: the arrow reader reads ahead in threads ('thread') or inline "
            "('dummy'); pass one of those, or reader='petastorm'"
        )
    if pool_type == "process" and importlib.util.find_spec("zmq") is None:
        raise ValueError(
            "reader_pool_type='process' needs pyzmq (petastorm's process pool talks to its "
            "workers through it), which is not installed: pip install pyzmq, or use "
            "reader_pool_type='thread'"
        )


def check_shard(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need 0 <= rank < size with size >= 1; got rank={rank}, size={size}")


class ShardReader:
    """This rank's batches: iterate for ``{column: ndarray}`` of ``batch_size`` rows
    (the last one shorter with ``drop_last=False``).

    A context manager; ``close()`` stops petastorm's reader threads. ``rows_read``
    counts the rows read so far; ``files`` are the files of the arrow reader's shard
    (empty for petastorm, which picks its row groups inside).
    """

    def __init__(
        self,
        path_or_url: str,
        *,
        rank: int,
        size: int,
        batch_size: int,
        columns: Sequence[str],
        reader: str = "petastorm",
        shuffle: bool = False,
        seed: int = 0,
        num_epochs: int | None = None,
        workers_count: int = 1,
        storage_options: Options = None,
        drop_last: bool = True,
        even: bool = True,
        pool_type: str = "thread",
    ):
        check_shard(rank, size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
        if not columns:
            raise ValueError("columns must name at least one column to read")
        self.reader = resolve_reader(reader)
        check_pool(pool_type, workers_count, self.reader)
        self.columns = list(columns)
        self.batch_size = batch_size
        rng = np.random.default_rng([seed, rank]) if shuffle else None
        self.rows_read = 0
        self.files: list[str] = []
        self._petastorm = None
        if self.reader == "petastorm":
            self._petastorm = open_petastorm(
                petastorm_url(path_or_url),
                rank,
                size,
                self.columns,
                num_epochs,
                shuffle,
                seed,
                workers_count,
                storage_options,
                pool_type,
            )
            chunks = petastorm_chunks(self._petastorm, self.columns)
        else:
            slices = arrow_slices(path_or_url, rank, size, storage_options, even)
            self.files = sorted({fragment.path for fragment, _, _ in slices})
            ahead = workers_count if pool_type == "thread" else 0
            chunks = arrow_chunks(slices, self.columns, num_epochs, rng, ahead)
        self._source = chunks
        self._chunks = self._counted(chunks)  # as read: one row group (or petastorm batch) each
        self._batches = rebatch(self._chunks, batch_size, rng, drop_last)

    def _counted(self, chunks: Iterable[Batch]) -> Iterator[Batch]:
        for chunk in chunks:
            self.rows_read += len(next(iter(chunk.values())))
            yield chunk

    def __iter__(self) -> Iterator[Batch]:
        return self._batches

    def __next__(self) -> Batch:
        return next(self._batches)

    def close(self) -> None:
        for gen in (self._batches, self._chunks, self._source):
            if hasattr(gen, "close"):  # the arrow reader's read-ahead threads stop here
                gen.close()
        if self._petastorm is not None:
            self._petastorm.stop()
            self._petastorm.join()
            self._petastorm = None

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def make_reader(
    path_or_url: str,
    *,
    rank: int,
    size: int,
    batch_size: int,
    columns: Sequence[str],
    reader: str = "petastorm",
    shuffle: bool = False,
    seed: int = 0,
    num_epochs: int | None = None,
    workers_count: int = 1,
    storage_options: Options = None,
    pool_type: str = "thread",
) -> ShardReader:
    """Open this rank's shard of the Parquet dataset at ``path_or_url`` (a local path,
    ``file://`` URL or fsspec URL, read in place) as batches of exactly ``batch_size`` rows.

    ``num_epochs=None`` reads forever (the caller counts its steps); ``shuffle``
    shuffles the order of row groups and the rows within each (seeded by ``seed``
    and the rank); ``storage_options`` go to ``fsspec.filesystem`` for a remote URL.

    ``pool_type`` and ``workers_count`` (Horovod's ``reader_pool_type`` and
    ``*_reader_num_workers``): petastorm decodes row groups in a pool of
    ``workers_count`` threads (``"thread"``), processes (``"process"``, needs pyzmq)
    or inline (``"dummy"``); the arrow reader reads ``workers_count`` row groups ahead
    in as many threads (``"thread"``) or reads each when it is needed (``"dummy"``).
    """
    return ShardReader(
        path_or_url,
        rank=rank,
        size=size,
        batch_size=batch_size,
        columns=columns,
        reader=reader,
        shuffle=shuffle,
        seed=seed,
        num_epochs=num_epochs,
        workers_count=workers_count,
        storage_options=storage_options,
        pool_type=pool_type,
    )


def iter_shard(
    path_or_url: str,
    *,
    rank: int,
    size: int,
    columns: Sequence[str],
    batch_size: int,
    reader: str = "petastorm",
    storage_options: Options = None,
    workers_count: int = 1,
    pool_type: str = "thread",
) -> ShardReader:
    """Every row of this rank's shard, once, streamed in batches of ``batch_size`` rows
    (the last one shorter): memory holds a batch and the row group being read, never
    the whole shard (e.g. for validation).

    The arrow reader splits the rows as evenly as it can (ranks differ by at most one
    row) and drops none; petastorm gives each rank whole row groups. ``workers_count``
    and ``pool_type`` are :func:`make_reader`'s.
    """
    return ShardReader(
        path_or_url,
        rank=rank,
        size=size,
        batch_size=batch_size,
        columns=columns,
        reader=reader,
        num_epochs=1,
        storage_options=storage_options,
        drop_last=False,
        even=False,
        workers_count=workers_count,
        pool_type=pool_type,
    )


def read_shard(
    path_or_url: str,
    *,
    rank: int,
    size: int,
    columns: Sequence[str],
    reader: str = "petastorm",
    storage_options: Options = None,
    workers_count: int = 1,
    pool_type: str = "thread",
) -> Batch:
    """Every row of this rank's shard, once, as ``{column: ndarray}`` (what
    :func:`iter_shard` streams, held whole: for ``inmemory_cache_all``)."""
    with iter_shard(
        path_or_url,
        rank=rank,
        size=size,
        columns=columns,
        batch_size=1,
        reader=reader,
        storage_options=storage_options,
        workers_count=workers_count,
        pool_type=pool_type,
    ) as shard:
        return concat(shard._chunks, columns)
