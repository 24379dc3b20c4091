"""The arrow reader: ``pyarrow.dataset`` sharded by rows, each rank a contiguous run of
``total_rows // size`` rows (or split as evenly as can be, for validation), read row group
by row group, optionally a few ahead in threads."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np

from ._columns import Batch, to_numpy_columns
from ._sources import Options, open_dataset

__all__ = ["arrow_chunks", "arrow_slices"]


def _row_group_pieces(path_or_url: str, storage_options: Options) -> list[tuple[Any, int]]:
    """Every row group of the dataset as ``(fragment, rows)``, in file-name order."""
    dataset = open_dataset(path_or_url, storage_options)
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


def arrow_slices(
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


def arrow_chunks(
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
