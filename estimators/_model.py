"""``RingModel``: the fitted model; ``transform(df)`` predicts on the executors.

Inference runs in Arrow batches through ``mapInArrow``: each task unpickles the
torch module once, then runs one forward pass per Arrow batch; the DataFrame's own
columns pass through untouched and ``<label>__output`` columns are appended. An
output column is ``double`` when the model gives one value per row, else
``array<double>`` — decided on the driver by running the model on one zero input —
and a dense Spark ML ``Vector`` when the label was a Vector at fit time (``label_kinds``,
recorded by ``fit`` and saved with the model): the worker's Arrow output is wrapped into
``VectorUDT``'s struct in the same task (:func:`_vectors_in`), for torch and Keras alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from pyspark.ml import Model
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame
from pyspark.sql.types import ArrayType, DataType, DoubleType, StructField, StructType

from ringcore._gpu import check_use_gpu
from ringcore.data import to_numpy_columns

from ._columns import check_columns, feature_expr, is_staged_as_is
from ._frameworks import KERAS, framework_of
from ._params import MODEL_PARAMS, GeneratedAccessors, init_params, with_params
from ._persistence import RingModelReader, RingModelWriter
from ._train_torch import as_outputs, to_device, to_inputs

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
    values = output.detach().to("cpu", torch.float64).reshape(rows, -1).numpy()
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
    device: torch.device,
) -> pa.RecordBatch:
    rows = batch.num_rows
    if rows == 0:
        outputs = [_empty(kind) for kind in kinds]
    else:
        with torch.no_grad():
            inputs = to_inputs(to_numpy_columns(batch, staged), staged)
            result = model(*[to_device(t, device) for t in inputs])
        outputs = [
            _to_arrow(o, rows, k)
            for o, k in zip(as_outputs(result, len(names)), kinds, strict=True)
        ]
    return pa.RecordBatch.from_arrays(
        batch.columns[:keep] + outputs, names=batch.schema.names[:keep] + names
    )


def task_device(use_gpu: bool | None) -> torch.device:
    """The device a transform task predicts on. ``use_gpu`` None: a GPU when the task
    sees CUDA; True: a GPU or a clear error; False: the CPU. The GPU is the one Spark
    assigned to the task (``spark.task.resource.gpu.amount``), else ``partition % count``."""
    if not check_use_gpu(use_gpu, "RingModel.transform"):
        return torch.device("cpu")
    from pyspark import TaskContext

    ctx = TaskContext.get()
    gpus = ctx.resources().get("gpu") if ctx is not None else None
    if gpus is not None and gpus.addresses and gpus.addresses[0].isdigit():
        index = int(gpus.addresses[0])
    else:
        index = ctx.partitionId() if ctx is not None else 0
    return torch.device("cuda", index % torch.cuda.device_count())


def _as_vector(column: pa.Array) -> pa.StructArray:
    """A ``double`` or ``list<double>`` Arrow column as ``VectorUDT``'s struct of dense
    vectors (type 1, size, no indices, values)."""
    if not pa.types.is_list(column.type):  # one value per row: vectors of size 1
        offsets = pa.array(np.arange(len(column) + 1, dtype=np.int32))
        column = pa.ListArray.from_arrays(offsets, column.cast(pa.float64()))
    rows = len(column)
    return pa.StructArray.from_arrays(
        [
            pa.array(np.ones(rows, dtype=np.int8)),
            pc.list_value_length(column).cast(pa.int32()),
            pa.nulls(rows, pa.list_(pa.int32())),
            column,
        ],
        names=["type", "size", "indices", "values"],
    )


def _vectors_in(
    predict: Callable[[Iterable[pa.RecordBatch]], Iterable[pa.RecordBatch]], positions: list[int]
) -> Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]:
    """``predict`` with its output columns at ``positions`` turned into dense Vectors."""

    def predict_vectors(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        for batch in predict(batches):
            columns = list(batch.columns)
            for i in positions:
                columns[i] = _as_vector(columns[i])
            yield pa.RecordBatch.from_arrays(columns, names=batch.schema.names)

    return predict_vectors


def _make_predict(
    model_bytes: bytes,
    staged: list[str],
    keep: int,
    names: list[str],
    kinds: list[DataType],
    use_gpu: bool | None = None,
):
    """The function ``mapInArrow`` runs once per task (so the model loads once per task,
    onto the task's device: :func:`task_device`)."""

    def predict(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        device = task_device(use_gpu)
        model = cloudpickle.loads(model_bytes).to(device)
        model.eval()
        for batch in batches:
            yield _predict_batch(model, batch, staged, keep, names, kinds, device)

    return predict


@with_params(MODEL_PARAMS)
class RingModel(GeneratedAccessors, Model, MLWritable, MLReadable["RingModel"]):
    """A torch model trained by :class:`RingEstimator`; ``transform`` appends its outputs.

    ``save(path)`` / ``RingModel.load(path)`` persist it as Spark ML does (see
    ``estimators._persistence``), inside a ``PipelineModel`` too.

    .. warning::
        ``RingModel.load`` (and ``PipelineModel.load`` of a pipeline holding one)
        unpickles the module's structure with cloudpickle, which runs any code the
        saved files hold. Load only models you trust, from a path that only you can
        write, as for ``torch.load(weights_only=False)``.
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
        label_kinds = self.getLabelKinds()
        if label_kinds is not None and len(label_kinds) != len(names):
            raise ValueError(
                f"label_kinds names {len(label_kinds)} kind(s) ({label_kinds}) but the model has "
                f"{len(names)} output(s); give one per label column with setLabelKinds([...])."
            )
        return kind

    def _transform(self, dataset: DataFrame) -> DataFrame:
        names, features = self._output_names(), self.getFeatureCols()
        kind = self._check(dataset, names)
        # A feature column already as the model reads it (float, array<float>) is read
        # in place; others get a converted copy. Every column crosses to Python and back
        # (mapInArrow passes them through), so no column travels twice without need.
        fields = [dataset.schema[c] for c in features]
        staged = [f.name if is_staged_as_is(f) else _STAGED.format(i) for i, f in enumerate(fields)]
        copies = [feature_expr(f, s) for f, s in zip(fields, staged, strict=True) if s != f.name]
        inputs = dataset.select("*", *copies) if copies else dataset
        kinds, predict = self._predictor(kind, dataset, staged, names)
        vectors = [i for i, k in enumerate(self.getLabelKinds() or []) if k == "vector"]
        if vectors:  # Vector labels at fit time: dense Vector outputs
            kinds = [VectorUDT() if i in vectors else k for i, k in enumerate(kinds)]
            predict = _vectors_in(predict, [len(dataset.columns) + i for i in vectors])
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
            cloudpickle.dumps(model), staged, len(dataset.columns), names, kinds, self.getUseGpu()
        )
        return kinds, predict
