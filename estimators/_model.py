"""``RingModel``: the fitted model; ``transform(df)`` predicts on the executors.

Inference runs in Arrow batches through ``mapInArrow``: each task unpickles the
torch module once, then runs one forward pass per Arrow batch; the DataFrame's own
columns pass through untouched and ``<label>__output`` columns are appended. An
output column is ``double`` when the model gives one value per row, else
``array<double>`` — decided on the driver by running the model on one zero input.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import torch
from pyspark.ml import Model
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame
from pyspark.sql.types import ArrayType, DataType, DoubleType, StructField, StructType

from ringcore.data import to_numpy_columns

from ._columns import check_columns, feature_expr
from ._frameworks import KERAS, framework_of
from ._params import MODEL_PARAMS, GeneratedAccessors, init_params, with_params
from ._persistence import RingModelReader, RingModelWriter
from ._train_torch import as_outputs, to_inputs

__all__ = ["RingModel"]

_STAGED = "__ringtrain_input_{}"


def _probe_outputs(model: torch.nn.Module, shapes: list[list[int]], count: int) -> list[DataType]:
    """Run ``model`` on one all-zero row: the Spark type of each output."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            zeros = [torch.zeros(1, *shape) for shape in shapes]
            outputs = as_outputs(model(*zeros), count)
    finally:
        model.train(was_training)
    return [
        DoubleType() if out.numel() == 1 else ArrayType(DoubleType(), containsNull=False)
        for out in outputs
    ]


def _to_arrow(output: torch.Tensor, rows: int, kind: DataType) -> pa.Array:
    values = output.detach().to(torch.float64).reshape(rows, -1).numpy()
    if isinstance(kind, DoubleType):
        return pa.array(values[:, 0], type=pa.float64())
    width = values.shape[1]
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=pa.float64()))


def _empty(kind: DataType) -> pa.Array:
    return pa.array(
        [], type=pa.float64() if isinstance(kind, DoubleType) else pa.list_(pa.float64())
    )


def _predict_batch(
    model: torch.nn.Module,
    batch: pa.RecordBatch,
    staged: list[str],
    keep: int,
    names: list[str],
    kinds: list[DataType],
) -> pa.RecordBatch:
    rows = batch.num_rows
    if rows == 0:
        outputs = [_empty(kind) for kind in kinds]
    else:
        with torch.no_grad():
            result = model(*to_inputs(to_numpy_columns(batch, staged), staged))
        outputs = [
            _to_arrow(o, rows, k)
            for o, k in zip(as_outputs(result, len(names)), kinds, strict=True)
        ]
    return pa.RecordBatch.from_arrays(
        batch.columns[:keep] + outputs, names=batch.schema.names[:keep] + names
    )


def _make_predict(
    model_bytes: bytes, staged: list[str], keep: int, names: list[str], kinds: list[DataType]
):
    """The function ``mapInArrow`` runs once per task (so the model loads once per task)."""

    def predict(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        model = cloudpickle.loads(model_bytes)
        model.eval()
        for batch in batches:
            yield _predict_batch(model, batch, staged, keep, names, kinds)

    return predict


@with_params(MODEL_PARAMS)
class RingModel(GeneratedAccessors, Model, MLWritable, MLReadable["RingModel"]):
    """A torch model trained by :class:`RingEstimator`; ``transform`` appends its outputs.

    ``save(path)`` / ``RingModel.load(path)`` persist it as Spark ML does (see
    ``estimators._persistence``), inside a ``PipelineModel`` too.
    """

    def __init__(self, **kwargs: Any):
        super().__init__()
        init_params(self, MODEL_PARAMS, kwargs)

    def write(self) -> RingModelWriter:
        return RingModelWriter(self)

    @classmethod
    def read(cls) -> RingModelReader:
        return RingModelReader(cls)

    def _output_names(self) -> list[str]:
        return self.getOutputCols() or [f"{label}__output" for label in self.getLabelCols()]

    def _feature_shapes(self, df: DataFrame, features: list[str]) -> list[list[int]]:
        shapes = self.getFeatureShapes()
        if shapes is not None:
            return [list(s) for s in shapes]
        first = df.select(*[feature_expr(df.schema[c]) for c in features]).first()
        if first is None:
            raise ValueError(
                "feature_shapes is not set and the DataFrame is empty; set it with setFeatureShapes([[n], ...])."
            )
        return [[len(first[c])] if isinstance(first[c], list) else [1] for c in features]

    def _check(self, df: DataFrame, names: list[str]) -> str:
        """Check the columns against ``df``; returns the model's framework."""
        model = self.getModel()
        if model is None:
            raise ValueError("this RingModel holds no model; set it with setModel(...).")
        kind = framework_of(model)
        check_columns(df.schema, self.getFeatureCols(), "feature", "setFeatureCols")
        clash = [n for n in names if n in df.columns]
        if clash:
            raise ValueError(
                f"output column(s) {', '.join(clash)} already exist in the DataFrame; "
                "drop them or choose other names with setOutputCols([...])."
            )
        if len(names) != len(self.getLabelCols()):
            raise ValueError(
                f"output_cols names {len(names)} column(s) but the model has "
                f"{len(self.getLabelCols())} output(s), one per label column."
            )
        return kind

    def _transform(self, dataset: DataFrame) -> DataFrame:
        names, features = self._output_names(), self.getFeatureCols()
        kind = self._check(dataset, names)
        staged = [_STAGED.format(i) for i in range(len(features))]
        inputs = dataset.select(
            "*",
            *[feature_expr(dataset.schema[c], s) for c, s in zip(features, staged, strict=True)],
        )
        kinds, predict = self._predictor(kind, dataset, staged, names)
        schema = StructType(
            dataset.schema.fields
            + [StructField(n, k, True) for n, k in zip(names, kinds, strict=True)]
        )
        return inputs.mapInArrow(predict, schema)

    def _predictor(
        self, kind: str, dataset: DataFrame, staged: list[str], names: list[str]
    ) -> tuple[list[DataType], Callable[[Iterable[pa.RecordBatch]], Iterable[pa.RecordBatch]]]:
        """The output column types and the per-task ``mapInArrow`` function for the
        model's framework (``kind``, from ``_frameworks.framework_of``)."""
        model = self.getModel()
        shapes = self._feature_shapes(dataset, self.getFeatureCols())
        if kind == KERAS:  # Keras: loaded from .keras bytes once per task (_train_keras.py)
            from ._train_keras import keras_predictor

            return keras_predictor(model, shapes, staged, len(dataset.columns), names)
        # torch nn.Module and LightningModule predict alike.
        kinds = _probe_outputs(model, shapes, len(names))
        predict = _make_predict(
            cloudpickle.dumps(model), staged, len(dataset.columns), names, kinds
        )
        return kinds, predict
