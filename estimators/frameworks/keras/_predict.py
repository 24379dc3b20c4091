"""``RingModel.transform`` of a Keras model, in Arrow batches.

:func:`keras_predictor` runs the model once on the driver, on one all-zero row, to type
each output column (``double`` for one value per row, else ``array<double>``), and
returns the function ``mapInArrow`` runs once per task: it loads the model from its
``.keras`` bytes once (Keras picks its own device), then predicts once per Arrow batch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
from pyspark.sql.types import ArrayType, DataType, DoubleType

from ringcore.data import to_numpy_columns

from ._model_io import custom_objects_of, model_from_bytes, model_to_bytes

__all__ = ["keras_predictor"]


def _outputs(result: Any, count: int) -> list[np.ndarray]:
    outs = [result] if not isinstance(result, list | tuple) else list(result)
    if len(outs) != count:
        raise ValueError(
            f"the Keras model returned {len(outs)} output(s) but label_cols names {count}"
        )
    return [np.asarray(o, np.float64) for o in outs]


def _to_arrow(values: np.ndarray, rows: int, kind: DataType) -> pa.Array:
    values = values.reshape(rows, -1)
    if isinstance(kind, DoubleType):
        return pa.array(values[:, 0], type=pa.float64())
    width = values.shape[1]
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=pa.float64()))


def _inputs(columns: dict[str, np.ndarray], staged: list[str]) -> Any:
    feats = [np.asarray(columns[c], np.float32) for c in staged]
    feats = [f.reshape(-1, 1) if f.ndim == 1 else f for f in feats]
    return feats[0] if len(feats) == 1 else feats


def keras_predictor(
    model: Any, shapes: list[list[int]], staged: list[str], keep: int, names: list[str]
) -> tuple[list[DataType], Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]]:
    """The output types (from one all-zero row) and the ``mapInArrow`` function: it
    loads the model once per task and predicts once per Arrow batch."""
    zeros = [np.zeros((1, *s), np.float32) for s in shapes]
    probe = _outputs(model(zeros[0] if len(zeros) == 1 else zeros, training=False), len(names))
    kinds: list[DataType] = [
        DoubleType() if o.size == 1 else ArrayType(DoubleType(), containsNull=False) for o in probe
    ]
    data, objects = model_to_bytes(model), custom_objects_of(model)

    def predict(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        loaded = model_from_bytes(data, custom_objects=objects)
        for batch in batches:
            rows = batch.num_rows
            if rows == 0:
                empty = [
                    pa.array([], type=pa.float64())
                    if isinstance(k, DoubleType)
                    else pa.array([], type=pa.list_(pa.float64()))
                    for k in kinds
                ]
                outs = empty
            else:
                result = loaded(_inputs(to_numpy_columns(batch, staged), staged), training=False)
                outs = [
                    _to_arrow(o, rows, k)
                    for o, k in zip(_outputs(result, len(names)), kinds, strict=True)
                ]
            yield pa.RecordBatch.from_arrays(
                batch.columns[:keep] + outs, names=batch.schema.names[:keep] + names
            )

    return kinds, predict
