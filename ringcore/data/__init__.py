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

from ._columns import to_numpy_columns
from ._reader import (
    POOL_TYPES,
    READERS,
    ShardReader,
    iter_shard,
    make_reader,
    petastorm_problems,
    read_shard,
    resolve_reader,
)
from ._sources import parquet_row_counts

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
