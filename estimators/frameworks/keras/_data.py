"""A Keras worker's data as ``tf.data`` pipelines: its training and validation shards.

Batches come from the same Parquet readers as every framework's loop; :func:`dataset`
turns this rank's (endless) training batches into a pipeline (``tensorflow_dataset_
prefetch_buffer_size`` batches prefetched), :func:`validation_dataset` streams the
rank's validation shard from the store again at every evaluation, never held whole.
TensorFlow is imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np

from ...data._batches import columns_of
from ...data._readers import validation_shard

__all__ = ["dataset", "validation_dataset"]


def _arrays(spec: Any, batch: dict[str, np.ndarray]) -> tuple:
    """``(inputs, labels[, weights])`` of one batch: float32, a scalar feature as (rows, 1);
    one array for one column, a tuple for several."""
    if spec.transformation_fn is not None:
        batch = spec.transformation_fn(batch)
    feats = [np.asarray(batch[c], np.float32) for c in spec.feature_cols]
    feats = [f.reshape(-1, 1) if f.ndim == 1 else f for f in feats]
    labels = [np.asarray(batch[c], np.float32) for c in spec.label_cols]
    item: tuple = (
        feats[0] if len(feats) == 1 else tuple(feats),
        labels[0] if len(labels) == 1 else tuple(labels),
    )
    if spec.sample_weight_col is not None:
        item += (np.asarray(batch[spec.sample_weight_col], np.float32).reshape(-1),)
    return item


def dataset(spec: Any, batches: Iterator[dict[str, np.ndarray]]) -> Any:
    """A ``tf.data.Dataset`` of this rank's (endless) batches; shapes from the first one."""
    import tensorflow as tf

    first = _arrays(spec, next(batches))

    def generate() -> Iterator[tuple]:
        yield first
        for batch in batches:
            yield _arrays(spec, batch)

    dataset = tf.data.Dataset.from_generator(generate, output_signature=_signature(first))
    return dataset.prefetch(spec.prefetch) if spec.prefetch > 0 else dataset


def _signature(first: tuple) -> Any:
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: tf.TensorSpec([None, *a.shape[1:]], tf.float32), first)


def validation_dataset(spec: Any, path: str | None, rank: int, size: int) -> Any:
    """This rank's validation shard as a ``tf.data.Dataset`` streamed from the store:
    every evaluation (each epoch) reads the shard once more in ``val_batch_size``
    batches (at most ``validation_steps_per_epoch`` of them), so memory holds a batch,
    never the shard. The shapes come from a first batch; None for an empty shard."""
    if path is None:
        return None
    import tensorflow as tf

    shard = validation_shard(spec, path, rank=rank, size=size, columns=columns_of(spec))
    batches = shard.__iter__()  # a generator: closed as soon as its first batch is out
    first = next(batches, None)
    batches.close()  # the first pass stops here: its reader is closed
    if first is None:
        return None

    def generate() -> Iterator[tuple]:
        for batch in shard:  # a fresh pass over the shard each time Keras evaluates
            yield _arrays(spec, batch)

    signature = _signature(_arrays(spec, first))
    return tf.data.Dataset.from_generator(generate, output_signature=signature)
