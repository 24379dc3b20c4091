"""Who writes a fit's Parquet into the Store: Spark's own writer, or the executors'
Python workers through fsspec and pyarrow.

Spark's writer goes through Hadoop, which knows a scheme only with its jars
(``s3a://`` needs hadoop-aws and the AWS SDK on the classpath) and takes its
credentials and endpoint from the Hadoop configuration, not from a Store's fsspec
``storage_options``. The arrow writer needs no jars: ``mapInArrow`` hands each
partition's Arrow batches to a Python worker, which writes them as one Parquet file
through ``fsspec`` with the store's ``storage_options``, then the driver collects
``(file, rows)`` per partition. It works on any cluster whose executors have the
fsspec implementation of the scheme (``s3fs`` for ``s3://``), Spark Connect included.

The choice (:func:`pick_writer`), made before any job:

- a path every worker mounts (LocalStore, DBFS, a volume): Spark;
- an FsspecStore with ``parquet_writer="spark"`` or ``"arrow"``: that one; ``"spark"``
  is refused up front where Spark's Hadoop has no filesystem for the scheme;
- ``"auto"``: Spark where Hadoop has the scheme and the store has no
  ``storage_options`` (which Spark could not honour), else arrow, logged with why.

Both write row groups of at most :data:`ROW_GROUP_ROWS` rows and about
:data:`ROW_GROUP_BYTES`, so a worker streaming its shard holds one row group at a time
however large the dataset grows (the rows cap counts as much as the bytes: petastorm
turns an array column into one numpy object per row).
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Iterator
from typing import Any

from ..store._store import FsspecStore, Store

__all__ = ["ROW_GROUP_BYTES", "ROW_GROUP_ROWS", "pick_writer", "spark_block_size", "write_parquet"]

log = logging.getLogger("ringtrain.estimators")

#: the target size of one row group, in bytes of Arrow data before encoding
ROW_GROUP_BYTES = 32 * 1024 * 1024
#: the most rows in one row group
ROW_GROUP_ROWS = 65_536


def _hadoop_problem(spark: Any, scheme: str) -> str | None:
    """Why Spark's Hadoop cannot write ``scheme`` (None: it can). On Spark Connect the
    client cannot ask the server's JVM: that is a reason too."""
    try:
        jvm = spark.sparkContext._jvm
        conf = spark.sparkContext._jsc.hadoopConfiguration()
    except Exception:  # Spark Connect: no JVM on this side
        return "this is a Spark Connect session, whose server's Hadoop cannot be asked"
    try:
        jvm.org.apache.hadoop.fs.FileSystem.getFileSystemClass(scheme, conf)
    except Exception as exc:
        lines = [line for line in str(exc).splitlines() if "Exception" in line]
        return (lines[0] if lines else type(exc).__name__).strip()
    return None


def pick_writer(spark: Any, store: Store) -> str:
    """``"spark"`` or ``"arrow"`` for a fit's Parquet in ``store`` (see the module
    docstring); a ValueError naming the scheme, the reason and the fix when
    ``parquet_writer="spark"`` cannot work. Starts no job."""
    if not isinstance(store, FsspecStore):
        return "spark"
    scheme = store.url(store.prefix_path).split("://", 1)[0]
    if store.parquet_writer == "arrow":
        return "arrow"
    if store.protocol == "file":  # Hadoop's local filesystem: always there
        return "spark"
    problem = _hadoop_problem(spark, scheme)
    if store.parquet_writer == "spark":
        if problem is not None:
            raise ValueError(
                f"FsspecStore({store.prefix_path!r}, parquet_writer='spark'): Spark cannot write "
                f"{scheme}:// here ({problem}). Put the Hadoop filesystem's jars on the "
                f"cluster (for s3a: hadoop-aws and the AWS SDK bundle, with spark.hadoop.fs."
                f"{scheme}.* settings), or use parquet_writer='arrow' or 'auto', which write "
                "through fsspec from the executors' Python workers."
            )
        return "spark"
    if problem is not None:
        log.info("Spark cannot write %s:// (%s): the executors write the Parquet", scheme, problem)
        return "arrow"
    if store.storage_options:
        log.info(
            "the store %s has storage_options, which Spark's Hadoop writer cannot take: "
            "the executors write the Parquet through fsspec",
            store.prefix_path,
        )
        return "arrow"
    return "spark"


def _partition_writer(
    url: str, options: dict[str, Any], row_group_bytes: int, row_group_rows: int
) -> Any:
    """The function ``mapInArrow`` runs on each partition: its batches into one Parquet
    file ``part-<partition>.parquet`` under ``url`` (a retried task overwrites its
    partition's file), one row of ``(file, rows)`` out."""

    def write(batches: Iterator[Any]) -> Iterator[Any]:
        import fsspec.core
        import pyarrow as pa
        import pyarrow.parquet as pq
        from pyspark import TaskContext

        fs, root = fsspec.core.url_to_fs(url, **options)
        context = TaskContext.get()
        partition = context.partitionId() if context is not None else 0
        name = posixpath.join(root, f"part-{partition:05d}.parquet")
        rows, pending, pending_bytes, pending_rows = 0, [], 0, 0
        stream = writer = None
        try:
            for batch in batches:
                if batch.num_rows == 0:
                    continue
                if writer is None:
                    fs.makedirs(root, exist_ok=True)
                    stream = fs.open(name, "wb")
                    writer = pq.ParquetWriter(stream, batch.schema)
                pending.append(batch)
                pending_bytes += batch.nbytes
                pending_rows += batch.num_rows
                if pending_bytes >= row_group_bytes or pending_rows >= row_group_rows:
                    table = pa.Table.from_batches(pending)
                    writer.write_table(table, row_group_size=row_group_rows)
                    rows, pending, pending_bytes, pending_rows = rows + table.num_rows, [], 0, 0
            if pending and writer is not None:
                table = pa.Table.from_batches(pending)
                writer.write_table(table, row_group_size=row_group_rows)
                rows += table.num_rows
        finally:
            if writer is not None:
                writer.close()
            if stream is not None:
                stream.close()
        yield pa.RecordBatch.from_pydict(
            {"file": [name if rows else ""], "rows": [rows]},
            schema=pa.schema([("file", pa.string()), ("rows", pa.int64())]),
        )

    return write


def spark_block_size(row_bytes: float | None) -> int:
    """Spark's ``parquet.block.size`` for row groups of about :data:`ROW_GROUP_ROWS`
    rows of ``row_bytes`` each (parquet-mr has no row cap): 1 MiB to ROW_GROUP_BYTES."""
    if not row_bytes:
        return ROW_GROUP_BYTES
    return int(min(ROW_GROUP_BYTES, max(1024 * 1024, ROW_GROUP_ROWS * row_bytes)))


def write_parquet(
    frame: Any,
    store: Store,
    path: str,
    files: int,
    writer: str,
    row_bytes: float | None = None,
) -> None:
    """``frame`` as ``files`` Parquet files (round-robin rows: equal to within a few)
    at ``path`` in ``store``, by ``writer`` (from :func:`pick_writer`); an existing
    ``path`` is an error, as Spark's ``mode("error")``. ``row_bytes`` (a row's size
    in memory, from the first rows) sizes Spark's row groups."""
    frame = frame.repartition(files)
    if writer == "spark":
        # "error" (= "errorifexists"): the one spelling a Spark Connect client accepts
        (
            frame.write.mode("error")
            .option("parquet.block.size", spark_block_size(row_bytes))
            .parquet(store.url(path))
        )
        return
    assert isinstance(store, FsspecStore)
    if store.exists(path):
        raise ValueError(f"the Parquet data path {path} exists already; it is not overwritten")
    options = dict(store.storage_options)
    write = _partition_writer(path, options, ROW_GROUP_BYTES, ROW_GROUP_ROWS)
    written = frame.mapInArrow(write, "file string, rows long").collect()
    log.info("the executors wrote %d rows in %d files to %s", sum(r.rows for r in written),
             sum(1 for r in written if r.file), path)  # fmt: skip
