"""How a worker reads its data from the Store: in place, streamed, its own row groups.

A worker opens its shard of the training and validation Parquet where the Store keeps
it (a local path, or a remote URL through fsspec: each rank fetches the footers and
its own row groups, never the whole dataset). Validation is streamed too: a
:class:`ValidationShard` opens a fresh one-pass reader each time it is iterated and
yields ``val_batch_size`` batches, so memory holds a batch, not the shard; the epoch's
sums are allreduced by the training loop as before.

Only a store built with ``local_copy=True`` copies each worker's dataset to its local
temporary directory first (:func:`data_paths`), for filesystems whose ranged reads
are too slow, or readers that need local files.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from ringcore.data import iter_shard, make_reader, parquet_row_counts, read_shard, resolve_reader

from ..store._store import Store
from ._spec import DataSpec

__all__ = [
    "ValidationShard",
    "data_paths",
    "open_training",
    "read_whole_shard",
    "validation_shard",
]

Batch = dict[str, np.ndarray]


def _options(store: Store, path: str) -> dict[str, Any] | None:
    """The reader's ``storage_options``: the store's for a URL it reads in place."""
    return store.read_options() if "://" in path and store.reads_in_place() else None


@contextlib.contextmanager
def data_paths(store: Store, train: str, val: str | None) -> Iterator[tuple[str, str | None]]:
    """The paths workers read the training and validation data by: the store's own
    (read in place), or, for a store with ``local_copy=True``, copies in a local
    temporary directory fetched through fsspec (removed afterwards)."""
    if store.is_local() or store.reads_in_place():
        yield train, val
        return
    train_copy = store.localize(train)
    try:
        val_copy = store.localize(val) if val is not None else None
    except BaseException:  # the training copy is not left behind
        shutil.rmtree(os.path.dirname(train_copy), ignore_errors=True)
        raise
    try:
        yield train_copy, val_copy
    finally:
        for copy in (train_copy, val_copy):
            if copy is not None:
                shutil.rmtree(os.path.dirname(copy), ignore_errors=True)


def open_training(store: Store, path: str, **kwargs: Any) -> Any:
    """``ringcore.data.make_reader`` of ``path`` (from :func:`data_paths`) through the
    store's filesystem; ``kwargs`` are make_reader's."""
    return make_reader(path, storage_options=_options(store, path), **kwargs)


def read_whole_shard(
    store: Store,
    path: str,
    *,
    rank: int,
    size: int,
    columns: list[str],
    reader: str,
    workers_count: int = 1,
    pool_type: str = "thread",
) -> Batch:
    """This rank's shard held whole in memory (``inmemory_cache_all`` asks for it)."""
    return read_shard(
        path,
        rank=rank,
        size=size,
        columns=columns,
        reader=reader,
        storage_options=_options(store, path),
        workers_count=workers_count,
        pool_type=pool_type,
    )


class ValidationShard:
    """This rank's validation shard, streamed: iterating it reads the shard once in
    batches of ``batch_size`` rows (the last one shorter), at most ``steps`` of them,
    with ``workers_count`` reader workers of ``pool_type`` (``val_reader_num_workers``,
    ``reader_pool_type``).
    ``rows`` is the shard's row count, ``len()`` its batch count, and ``batches_read``
    / ``rows_read`` count what the last pass read."""

    def __init__(
        self,
        store: Store,
        path: str,
        *,
        rank: int,
        size: int,
        columns: list[str],
        reader: str,
        batch_size: int,
        steps: int | None = None,
        workers_count: int = 1,
        pool_type: str = "thread",
    ) -> None:
        self.store, self.path, self.rank, self.size = store, path, rank, size
        self.workers_count, self.pool_type = workers_count, pool_type
        self.columns, self.batch_size, self.steps = columns, batch_size, steps
        self.reader = resolve_reader(reader)
        self.batches_read = 0
        self.rows_read = 0
        self._rows: int | None = None

    @property
    def rows(self) -> int:
        if self._rows is None:
            self._rows = self._count_rows()
        return self._rows

    def _open(self) -> Any:
        return iter_shard(
            self.path,
            rank=self.rank,
            size=self.size,
            columns=self.columns,
            batch_size=self.batch_size,
            reader=self.reader,
            storage_options=_options(self.store, self.path),
            workers_count=self.workers_count,
            pool_type=self.pool_type,
        )

    def _count_rows(self) -> int:
        """The shard's rows: arrow's split from the footers; petastorm's row groups are
        only known by reading them, so one pass counts them (columns read: the first)."""
        if self.reader == "arrow":
            total = sum(parquet_row_counts(self.path, _options(self.store, self.path)))
            return (self.rank + 1) * total // self.size - self.rank * total // self.size
        rows = 0  # only len() needs it (Lightning's progress): counted when first asked
        with iter_shard(
            self.path,
            rank=self.rank,
            size=self.size,
            columns=self.columns[:1],
            batch_size=max(self.batch_size, 1024),
            reader=self.reader,
            storage_options=_options(self.store, self.path),
        ) as shard:
            for batch in shard:
                rows += len(next(iter(batch.values())))
        return rows

    def __len__(self) -> int:
        batches = -(-self.rows // self.batch_size)
        return batches if self.steps is None else min(batches, self.steps)

    def __iter__(self) -> Generator[Batch, None, None]:
        self.batches_read = self.rows_read = 0
        with self._open() as shard:
            for batch in shard:
                if self.steps is not None and self.batches_read >= self.steps:
                    break
                self.batches_read += 1
                self.rows_read += len(next(iter(batch.values())))
                yield batch


def validation_shard(
    spec: DataSpec, path: str, *, rank: int, size: int, columns: list[str]
) -> ValidationShard:
    """The rank's :class:`ValidationShard` of ``path`` as a fit's spec reads it:
    ``val_batch_size`` batches, at most ``val_steps``, ``val_reader_num_workers``
    workers of ``reader_pool_type`` (the torch, Lightning and Keras loops alike)."""
    return ValidationShard(
        spec.store,
        path,
        rank=rank,
        size=size,
        columns=columns,
        reader=spec.reader,
        batch_size=spec.val_batch_size,
        steps=spec.val_steps,
        workers_count=spec.val_reader_workers,
        pool_type=spec.reader_pool,
    )
