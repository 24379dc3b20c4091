"""A worker's batches of one epoch, as every framework's training loop reads them.

The training shard is read once per epoch in ``batch_size`` batches, shuffled by
``(random_seed, epoch)`` (so a resumed run draws what an uninterrupted one would), the
last partial batch dropped; ``inmemory_cache_all`` serves them from the shard held in
memory instead. The validation shard is streamed each time it is iterated
(:class:`~._readers.ValidationShard`). Each function takes the rank and the world size
from its caller: this module knows no framework and no ring.
"""

from __future__ import annotations

from collections.abc import Generator, Iterator
from typing import Any

import numpy as np

from ._columns import read_columns
from ._readers import ValidationShard, open_training, read_whole_shard, validation_shard
from ._spec import DataSpec

__all__ = [
    "columns_of",
    "epoch_batches",
    "epoch_seed",
    "load_shard",
    "load_validation",
    "memory_batches",
    "training_batches",
    "transformed",
    "val_batches",
]

Batch = dict[str, np.ndarray]


def columns_of(spec: DataSpec) -> list[str]:
    """The columns a worker reads: features, labels, then the weight column if any."""
    return read_columns(spec.feature_cols, spec.label_cols, spec.sample_weight_col)


def transformed(spec: DataSpec, batch: Batch) -> Batch:
    """``batch`` through the fit's ``transformation_fn`` (as it is without one)."""
    return batch if spec.transformation_fn is None else spec.transformation_fn(batch)


def epoch_seed(spec: DataSpec, epoch: int, extra: int = 0) -> int:
    """Shuffles and the framework's RNG depend on (random_seed, epoch) only, so a
    resumed run draws what an uninterrupted one would."""
    return (spec.seed * 1_000_003 + epoch * 1009 + extra) % 2**31


def load_validation(spec: DataSpec, path: str | None, rank: int, size: int) -> Any:
    """This rank's :class:`ValidationShard`, streamed batch by batch each time it is
    iterated (None without validation data)."""
    if path is None:
        return None
    return validation_shard(spec, path, rank=rank, size=size, columns=columns_of(spec))


def val_batches(spec: DataSpec, data: ValidationShard) -> Iterator[Batch]:
    for batch in data:  # streamed from the store: val_batch_size rows, val_steps at most
        yield transformed(spec, batch)


def load_shard(spec: DataSpec, path: str, rank: int, size: int) -> Batch:
    """This rank's training shard held whole in memory (``inmemory_cache_all``)."""
    return read_whole_shard(
        spec.store,
        path,
        rank=rank,
        size=size,
        columns=columns_of(spec),
        reader=spec.reader,
        workers_count=spec.reader_workers,
        pool_type=spec.reader_pool,
    )


def memory_batches(
    spec: DataSpec, data: Batch, epoch: int, rank: int
) -> Generator[dict[str, Any], None, None]:
    """``inmemory_cache_all``: the epoch's batches out of the shard held in memory,
    in the order ``(random_seed, epoch)`` draws; the last partial batch dropped."""
    rows = len(data[spec.label_cols[0]])
    if rows == 0:
        return
    reps = -(-spec.batch_size // rows)  # a shard smaller than a batch: repeat it
    data = {k: np.concatenate([v] * reps) for k, v in data.items()} if reps > 1 else data
    rows *= reps
    for extra in range(1_000_000):
        if spec.shuffle:
            order = np.random.default_rng([epoch_seed(spec, epoch, extra), rank])
            index = order.permutation(rows)
        else:
            index = np.arange(rows)
        for start in range(0, rows - spec.batch_size + 1, spec.batch_size):
            picked = index[start : start + spec.batch_size]
            yield {k: v[picked] for k, v in data.items()}


def epoch_batches(
    spec: DataSpec, train_path: str, epoch: int, rank: int, size: int
) -> Generator[dict[str, Any], None, None]:
    """This rank's batches of one epoch: one pass over its shard, shuffled by
    ``(random_seed, epoch)``, the last partial batch dropped, so every row is seen at
    most once per epoch. A shard a batch short of ``steps_per_epoch`` (petastorm's
    row-group shards may differ by a few rows, and a tiny dataset may hold less than
    a batch per rank) goes on reading passes without a break until the steps are done."""
    for num_epochs, extra in ((1, 0), (None, 1)):
        with open_training(
            spec.store,
            train_path,
            rank=rank,
            size=size,
            batch_size=spec.batch_size,
            columns=columns_of(spec),
            reader=spec.reader,
            shuffle=spec.shuffle,
            seed=epoch_seed(spec, epoch, extra),
            num_epochs=num_epochs,
            workers_count=spec.reader_workers,
            pool_type=spec.reader_pool,
        ) as reader:
            yield from reader


def training_batches(
    spec: DataSpec, train_path: str, cached: Batch | None, epoch: int, rank: int, size: int
) -> Generator[dict[str, Any], None, None]:
    """The epoch's ``steps_per_epoch`` batches, transformed: from the shard in memory
    (``cached``) or read from ``train_path``. Close it to stop the epoch's reader."""
    if cached is not None:
        batches = memory_batches(spec, cached, epoch, rank)
    else:
        batches = epoch_batches(spec, train_path, epoch, rank, size)
    try:
        for step in range(spec.steps_per_epoch):
            batch = next(batches, None)
            if batch is None:
                raise RuntimeError(
                    f"the training reader of {spec.train_path} gave no batch at step {step}; "
                    "this rank's shard is empty"
                )
            yield transformed(spec, batch)
    finally:
        batches.close()  # stops the epoch's reader (petastorm's threads)
