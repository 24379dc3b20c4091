"""Arrow to numpy, and batches of a fixed size out of chunks of any size."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["Batch", "column_to_numpy", "concat", "rebatch", "stack_objects", "to_numpy_columns"]

Batch = dict[str, np.ndarray]


def column_to_numpy(name: str, column: Any) -> np.ndarray:
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
    return {c: column_to_numpy(c, table.column(c)) for c in columns}


def stack_objects(name: str, values: np.ndarray) -> np.ndarray:
    if values.dtype != object:
        return values
    if len(values) == 0:
        return values.reshape(0, 0)
    try:
        return np.stack(list(values))
    except ValueError as exc:
        raise ValueError(f"column {name!r}: rows hold arrays of different shapes ({exc})") from exc


def rebatch(
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


def concat(chunks: Iterable[Batch], columns: Sequence[str]) -> Batch:
    collected = list(chunks)
    if not collected:
        return {c: np.zeros((0,)) for c in columns}
    return {c: np.concatenate([chunk[c] for chunk in collected]) for c in columns}
