"""The Parquet reader seam: every rank reads its shard of a Parquet dataset as
fixed-size batches of numpy arrays, whichever runner started it.

``make_reader(path, rank=, size=, batch_size=, columns=)`` returns a
:class:`ShardReader`: iterate it for dicts ``{column: ndarray}`` of exactly
``batch_size`` rows (infinite when ``num_epochs=None``; a last partial batch is
dropped). Two readers sit behind it:

- ``"petastorm"`` — ``petastorm.make_batch_reader`` with ``cur_shard=rank,
  shard_count=size``. Petastorm shards by *row group*, so ranks get equal data only
  when the dataset has balanced row groups (the estimators write one row group per
  file, one file per rank).
- ``"arrow"`` — ``pyarrow.dataset``, sharded by *rows*: every rank gets
  ``total_rows // size`` contiguous rows, whatever the files look like.

``"auto"`` picks petastorm when it is installed and the stack check
(``ringcore._stackcheck``) finds it working, else arrow. ``iter_shard`` streams a
rank's shard once in batches of at most ``batch_size`` rows, dropping none (for
validation: memory holds one batch, not the shard); ``read_shard`` is the same rows
concatenated; ``parquet_row_counts`` reads the row count of every file from the
footers. Array columns (``list<float>``) become 2-D arrays.

The dataset is a local path, a ``file://`` URL, or any fsspec URL (``s3://bucket/x``,
``gs://...``; ``storage_options`` go to ``fsspec.filesystem``): a remote dataset is
read in place, each rank fetching only its own row groups (Parquet footers and
column chunks through ranged reads), never a copy of the whole. A reader counts what
it read: ``rows_read``, and ``files`` (the arrow reader's files of this shard).

This module imports neither pyspark nor ray; petastorm and fsspec only inside the
functions that use them.
"""

from __future__ import annotations

import importlib.util
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = [
    "POOL_TYPES",
    "READERS",
    "ShardReader",
    "iter_shard",
    "make_reader",
    "parquet_row_counts",
    "petastorm_problems",
    "read_shard",
    "resolve_reader",
    "to_numpy_columns",
]

READERS = ("auto", "petastorm", "arrow")
POOL_TYPES = ("thread", "process", "dummy")

Batch = dict[str, np.ndarray]


# --- paths and choices --------------------------------------------------------------


Options = dict[str, Any] | None


def _is_remote(path_or_url: str) -> bool:
    text = str(path_or_url)
    return "://" in text and not text.startswith("file://")


def _local_path(path_or_url: str) -> str:
    text = str(path_or_url)
    return text[len("file://") :] if text.startswith("file://") else text


def _petastorm_url(path_or_url: str) -> str:
    return str(path_or_url) if _is_remote(path_or_url) else "file://" + _local_path(path_or_url)


def _read_options(url: str, storage_options: Options) -> dict[str, Any]:
    """``storage_options`` for reading Parquet in place: a filesystem that takes
    ``default_cache_type`` (s3fs, gcsfs, adlfs) gets ``"none"`` unless the caller chose
    one. Their default read-ahead cache turns every ranged read of a column chunk into
    one of ``default_block_size`` (50 MiB on s3fs), held per open file: more bytes
    fetched and more memory than the row group needs. pyarrow already coalesces a row
    group's column chunks into few exact ranged reads (``pre_buffer``)."""
    import inspect

    import fsspec

    options = dict(storage_options or {})
    if "default_cache_type" in options or "://" not in str(url):
        return options
    try:
        cls = fsspec.get_filesystem_class(str(url).split("://", 1)[0])
        takes = "default_cache_type" in inspect.signature(cls.__init__).parameters
    except (ImportError, ValueError, TypeError):
        return options  # url_to_fs says what is missing
    return {**options, "default_cache_type": "none"} if takes else options


def _dataset(path_or_url: str, storage_options: Options) -> Any:
    """The ``pyarrow.dataset`` at a local path or fsspec URL (footers only: no rows read)."""
    import pyarrow.dataset as pads

    if not _is_remote(path_or_url):
        return pads.dataset(_local_path(path_or_url), format="parquet")
    import fsspec.core

    try:
        fs, path = fsspec.core.url_to_fs(
            str(path_or_url), **_read_options(path_or_url, storage_options)
        )
    except (ImportError, ValueError) as exc:
        raise ValueError(
            f"cannot open the Parquet dataset {path_or_url!r} through fsspec: {exc}. Install "
            "the fsspec implementation of its scheme (s3fs for s3://, gcsfs for gs://, adlfs "
            "for abfs://) or pass a local path."
        ) from exc
    return pads.dataset(path, format="parquet", filesystem=fs)


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
    from . import _stackcheck

    return _stackcheck.check()


def _check_pool(pool_type: str, workers_count: int, reader: str) -> None:
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


def _check_shard(rank: int, size: int) -> None:
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"need 0 <= rank < size with size >= 1; got rank={rank}, size={size}")


# --- Arrow → numpy --------------------------------------------------------------------


def _column_to_numpy(name: str, column: Any) -> np.ndarray:
    import pyarrow as pa
    import pyarrow.compute as pc

    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if not (
        pa.types.is_list(column.type)
        or pa.types.is_large_list(column.type)
        or pa.types.is_fixed_size_list(column.type)
    ):
        return column.to_numpy(zero_copy_only=False)
    if column.null_count:
        raise ValueError(
            f"column {name!r} has {column.null_count} null arrays; drop or fill them first"
        )
    n = len(column)
    if n == 0:
        return np.zeros((0, 0), dtype=column.type.value_type.to_pandas_dtype())
    lengths = pc.list_value_length(column)
    shortest, longest = pc.min(lengths).as_py(), pc.max(lengths).as_py()
    if shortest != longest:
        raise ValueError(
            f"column {name!r} holds arrays of different lengths ({shortest} to {longest}); "
            "every row of an array column must have the same length"
        )
    return column.flatten().to_numpy(zero_copy_only=False).reshape(n, longest)


def to_numpy_columns(table: Any, columns: Sequence[str]) -> Batch:
    """``{column: ndarray}`` from a pyarrow Table or RecordBatch; list columns → 2-D."""
    return {c: _column_to_numpy(c, table.column(c)) for c in columns}


def _stack_objects(name: str, values: np.ndarray) -> np.ndarray:
    if values.dtype != object:
        return values
    if len(values) == 0:
        return values.reshape(0, 0)
    try:
        return np.stack(list(values))
    except ValueError as exc:
        raise ValueError(f"column {name!r}: rows hold arrays of different shapes ({exc})") from exc


# --- re-batching ------------------------------------------------------------------------


def _rebatch(
    chunks: Iterable[Batch],
    batch_size: int,
    rng: np.random.Generator | None,
    drop_last: bool = True,
) -> Iterator[Batch]:
    """Exactly ``batch_size`` rows per batch out of chunks of any size (views where it
    can); the last partial batch is dropped, or yielded with ``drop_last=False``."""
    buffer: Batch | None = None
    offset = 0
    for chunk in chunks:
        n = len(next(iter(chunk.values())))
        if n == 0:
            continue
        if rng is not None:
            order = rng.permutation(n)
            chunk = {k: v[order] for k, v in chunk.items()}
        if buffer is not None and offset < len(next(iter(buffer.values()))):
            chunk = {k: np.concatenate([buffer[k][offset:], chunk[k]]) for k in chunk}
        buffer, offset = chunk, 0
        rows = len(next(iter(buffer.values())))
        while rows - offset >= batch_size:
            yield {k: v[offset : offset + batch_size] for k, v in buffer.items()}
            offset += batch_size
    if not drop_last and buffer is not None and offset < len(next(iter(buffer.values()))):
        yield {k: v[offset:] for k, v in buffer.items()}


# --- petastorm ----------------------------------------------------------------------------


def _quiet_petastorm() -> None:
    """Petastorm 0.12 calls pyarrow APIs deprecated since pyarrow 5, with a FutureWarning
    each time, from its reader threads too; nobody downstream can act on them. Ignore
    exactly those: FutureWarnings attributed to petastorm's own modules."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")


def _petastorm_filesystem(url: str, storage_options: Options) -> Any:
    """For a remote URL, the fsspec filesystem wrapped as the legacy
    ``pyarrow.filesystem`` kind that petastorm 0.12's ``ParquetDataset`` calls need
    (pyarrow 14's new dataset API refuses petastorm's arguments); None for a local path."""
    if not _is_remote(url):
        return None
    import fsspec.core

    fs = fsspec.core.url_to_fs(url, **_read_options(url, storage_options))[0]
    with warnings.catch_warnings():  # DaskFileSystem is deprecated: petastorm needs it
        warnings.simplefilter("ignore", FutureWarning)
        return _legacy_class()(fs)


_LEGACY: list[type] = []


def _legacy_class() -> type:
    """The legacy filesystem class, made on first use (its base is deprecated and warns
    on import); it is this module's ``_LegacyFilesystem``, so petastorm's process pool
    can pickle an instance by reference."""
    if _LEGACY:
        return _LEGACY[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from pyarrow.filesystem import DaskFileSystem

    class _LegacyFilesystem(DaskFileSystem):
        def isdir(self, path: str) -> bool:
            return bool(self.fs.isdir(path))

        def isfile(self, path: str) -> bool:
            return bool(self.fs.isfile(path))

        @property
        def pathsep(self) -> str:
            return "/"

        def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
            for root, dirs, files in self.fs.walk(path):
                yield root, sorted(dirs), sorted(files)

    _LegacyFilesystem.__module__ = __name__
    _LegacyFilesystem.__qualname__ = "_LegacyFilesystem"
    _LEGACY.append(_LegacyFilesystem)
    return _LegacyFilesystem


def __getattr__(name: str) -> Any:  # pickle finds the lazily made class by its name
    if name == "_LegacyFilesystem":
        return _legacy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _open_petastorm(
    url: str,
    rank: int,
    size: int,
    columns: Sequence[str],
    num_epochs: int | None,
    shuffle: bool,
    seed: int,
    workers_count: int,
    storage_options: Options = None,
    pool_type: str = "thread",
) -> Any:
    from petastorm import make_batch_reader
    from petastorm.errors import NoDataAvailableError

    _quiet_petastorm()
    try:
        return make_batch_reader(
            url,
            schema_fields=[re.escape(c) + "$" for c in columns],
            cur_shard=rank,
            shard_count=size,
            num_epochs=num_epochs,
            shuffle_row_groups=shuffle,
            seed=seed,
            workers_count=workers_count,
            reader_pool_type=pool_type,
            # a few row groups decoded ahead, not petastorm's 50: memory stays flat
            results_queue_size=max(2, 2 * workers_count),
            filesystem=_petastorm_filesystem(url, storage_options),
        )
    except NoDataAvailableError as exc:
        raise ValueError(
            f"the Parquet dataset {url} has fewer row groups than the {size} ranks reading it, so "
            f"petastorm leaves some rank without data ({exc}). Write at least {size} row groups, "
            "or use reader='arrow', which shards by rows."
        ) from exc


def _petastorm_chunks(reader: Any, columns: Sequence[str]) -> Iterator[Batch]:
    for batch in reader:
        found = batch._asdict()
        yield {c: _stack_objects(c, np.asarray(found[c])) for c in columns}


# --- arrow ----------------------------------------------------------------------------------


def _row_group_pieces(path_or_url: str, storage_options: Options) -> list[tuple[Any, int]]:
    """Every row group of the dataset as ``(fragment, rows)``, in file-name order."""
    dataset = _dataset(path_or_url, storage_options)
    pieces = []
    for fragment in sorted(dataset.get_fragments(), key=lambda f: f.path):
        for group in fragment.split_by_row_group():
            pieces.append((group, group.row_groups[0].num_rows))
    return pieces


def _shard_slices(
    pieces: list[tuple[Any, int]], start: int, stop: int
) -> list[tuple[Any, int, int]]:
    """Rows ``[start, stop)`` of the dataset as ``(row-group fragment, first row, rows)``."""
    slices, offset = [], 0
    for fragment, rows in pieces:
        lo, hi = max(start, offset), min(stop, offset + rows)
        if lo < hi:
            slices.append((fragment, lo - offset, hi - lo))
        offset += rows
    return slices


def _read_slice(piece: tuple[Any, int, int], columns: Sequence[str]) -> Batch:
    fragment, first, rows = piece
    return to_numpy_columns(fragment.to_table(columns=list(columns)).slice(first, rows), columns)


def _read_slices(
    slices: Iterable[tuple[Any, int, int]], columns: Sequence[str], ahead: int = 0
) -> Iterator[Batch]:
    """The slices' rows in order; ``ahead`` > 0 reads that many row groups ahead in as
    many threads (pyarrow drops the GIL while it fetches and decodes), so the next row
    group is on its way while the caller trains on this one: memory holds ``ahead``
    more row groups."""
    if ahead <= 0:
        for piece in slices:
            yield _read_slice(piece, columns)
        return
    from collections import deque
    from concurrent.futures import ThreadPoolExecutor

    pending: deque[Any] = deque()
    pool = ThreadPoolExecutor(ahead, thread_name_prefix="ringtrain-reader")
    try:
        for piece in slices:
            pending.append(pool.submit(_read_slice, piece, columns))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:  # a reader closed early: drop what was read ahead, wait for the threads
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)


def _arrow_slices(
    path_or_url: str, rank: int, size: int, storage_options: Options, even: bool
) -> list[tuple[Any, int, int]]:
    """This rank's rows as row-group slices: ``total // size`` rows each (``even``, for
    training: the same on every rank), or ``[rank*total//size, (rank+1)*total//size)``
    (ranks differ by at most one row, none dropped: validation)."""
    pieces = _row_group_pieces(path_or_url, storage_options)
    total = sum(rows for _, rows in pieces)
    if even:
        return _shard_slices(pieces, rank * (total // size), (rank + 1) * (total // size))
    return _shard_slices(pieces, rank * total // size, (rank + 1) * total // size)


def _arrow_chunks(
    slices: list[tuple[Any, int, int]],
    columns: Sequence[str],
    num_epochs: int | None,
    rng: np.random.Generator | None,
    ahead: int = 0,
) -> Iterator[Batch]:
    def ordered() -> Iterator[tuple[Any, int, int]]:
        epoch = 0
        while slices and (num_epochs is None or epoch < num_epochs):
            order = rng.permutation(len(slices)) if rng is not None else range(len(slices))
            yield from (slices[i] for i in order)
            epoch += 1

    yield from _read_slices(ordered(), columns, ahead)


# --- the public face -------------------------------------------------------------------------


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
        _check_shard(rank, size)
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_epochs is not None and num_epochs < 1:
            raise ValueError(f"num_epochs must be >= 1 or None (forever), got {num_epochs}")
        if not columns:
            raise ValueError("columns must name at least one column to read")
        self.reader = resolve_reader(reader)
        _check_pool(pool_type, workers_count, self.reader)
        self.columns = list(columns)
        self.batch_size = batch_size
        rng = np.random.default_rng([seed, rank]) if shuffle else None
        self.rows_read = 0
        self.files: list[str] = []
        self._petastorm = None
        if self.reader == "petastorm":
            self._petastorm = _open_petastorm(
                _petastorm_url(path_or_url),
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
            chunks = _petastorm_chunks(self._petastorm, self.columns)
        else:
            slices = _arrow_slices(path_or_url, rank, size, storage_options, even)
            self.files = sorted({fragment.path for fragment, _, _ in slices})
            ahead = workers_count if pool_type == "thread" else 0
            chunks = _arrow_chunks(slices, self.columns, num_epochs, rng, ahead)
        self._source = chunks
        self._chunks = self._counted(chunks)  # as read: one row group (or petastorm batch) each
        self._batches = _rebatch(self._chunks, batch_size, rng, drop_last)

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


def _concat(chunks: Iterable[Batch], columns: Sequence[str]) -> Batch:
    collected = list(chunks)
    if not collected:
        return {c: np.zeros((0,)) for c in columns}
    return {c: np.concatenate([chunk[c] for chunk in collected]) for c in columns}


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
        return _concat(shard._chunks, columns)


def parquet_row_counts(path_or_url: str, storage_options: Options = None) -> list[int]:
    """Rows of every file of the Parquet dataset (from the footers), in file-name order."""
    dataset = _dataset(path_or_url, storage_options)
    return [f.metadata.num_rows for f in sorted(dataset.get_fragments(), key=lambda f: f.path)]
