"""``RingModel``: the fitted model; ``transform(df)`` predicts on the executors.

Inference runs in Arrow batches through ``mapInArrow``, with the function the model's
framework gives (``estimators.frameworks``: ``framework_of(model).predictor``): each task loads the
model once, then runs one forward pass per Arrow batch; the DataFrame's own columns
pass through untouched and ``<label>__output`` columns are appended. An output column
is ``double`` when the model gives one value per row, else ``array<double>`` — decided
on the driver by running the model on one zero input — and a dense Spark ML ``Vector``
when the label was a Vector at fit time (``label_kinds``, recorded by ``fit`` and saved
with the model): the worker's Arrow output is wrapped into ``VectorUDT``'s struct in the
same task (:func:`_vectors_in`), for every framework alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import keyword_only
from pyspark.ml import Model
from pyspark.ml.linalg import VectorUDT
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame
from pyspark.sql.types import DataType, StructField, StructType

from ._accessors import ModelAccessors
from ._params import MODEL_PARAMS, init_params, with_params
from ._persistence import RingModelReader, RingModelWriter
from .data._columns import check_columns, feature_expr, is_staged_as_is
from .frameworks._base import Framework, Predictor
from .frameworks._registry import foreign_param, framework_of
from .store._store import Store

__all__ = ["RingModel"]

_STAGED = "__ringtrain_input_{}"


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


def _shape_of(value: Any) -> list[int]:
    """One row's shape: ``[n]`` for an array, ``[1]`` for a number, ``[]`` for a text
    (a string, which the model's framework tokenizes)."""
    if isinstance(value, list):
        return [len(value)]
    return [] if isinstance(value, str) else [1]


@with_params(MODEL_PARAMS)
class RingModel(ModelAccessors, Model, MLWritable, MLReadable["RingModel"]):
    """A model trained by :class:`RingEstimator`; ``transform`` appends its outputs.

    Params (each with a generated ``getX`` / ``setX``) are listed in
    ``estimators._params.MODEL_PARAMS``; the constructor takes them by keyword.

    ``save(path)`` / ``RingModel.load(path)`` persist it as Spark ML does (see
    ``estimators._persistence``), inside a ``PipelineModel`` too.

    .. warning::
        ``RingModel.load`` (and ``PipelineModel.load`` of a pipeline holding one)
        unpickles the module's structure with cloudpickle, which runs any code the
        saved files hold. Load only models you trust, from a path that only you can
        write, as for ``torch.load(weights_only=False)``.
    """

    @keyword_only
    def __init__(
        self,
        *,
        model: Any = None,
        history: Sequence[dict[str, Any]] = [],
        run_id: str | None = None,
        feature_cols: str | Sequence[str] | None = None,
        label_cols: str | Sequence[str] | None = None,
        label_kinds: str | Sequence[str] | None = None,
        output_cols: str | Sequence[str] | None = None,
        feature_shapes: Any = None,
        store: Store | str | None = None,
        use_gpu: bool | None = None,
        tokenizer: Any = None,
        max_length: int | None = None,
        model_output: str | None = None,
    ) -> None:
        """Every param of ``MODEL_PARAMS`` as a keyword, defaults as in that table
        (tests/estimators/test_estimator_signature.py keeps them equal)."""
        super().__init__()
        init_params(self, MODEL_PARAMS, self.__dict__.pop("_input_kwargs"))

    def write(self) -> RingModelWriter:
        return RingModelWriter(self)

    @classmethod
    def read(cls) -> RingModelReader:
        return RingModelReader(cls)

    def _columns(self, name: str) -> list[str]:
        """``feature_cols`` / ``label_cols``: a model without them fails in transform."""
        return self.getOrDefault(name)

    def _output_names(self) -> list[str]:
        return self.getOutputCols() or [f"{label}__output" for label in self._columns("label_cols")]

    def _feature_shapes(self, df: DataFrame, features: list[str]) -> list[list[int]]:
        shapes = self.getFeatureShapes()
        if shapes is not None:
            return [list(s) for s in shapes]
        typed = framework_of(self.getModel()).typed_features
        first = df.select(*[feature_expr(df.schema[c], typed=typed) for c in features]).first()
        if first is None:
            raise ValueError(
                "feature_shapes is not set and the DataFrame is empty; set it with setFeatureShapes([[n], ...])."
            )
        return [_shape_of(first[c]) for c in features]

    def _check(self, df: DataFrame, names: list[str]) -> Framework:
        """Check the columns against ``df``; returns the model's framework."""
        model = self.getModel()
        if model is None:
            raise ValueError("this RingModel holds no model; set it with setModel(...).")
        framework = framework_of(model)
        self._refuse_foreign_params(framework)
        features, text = self._columns("feature_cols"), self.getTokenizer() is not None
        check_columns(df.schema, features, "feature", "setFeatureCols", text=text)
        clash = [n for n in names if n in df.columns]
        if clash:
            raise ValueError(
                f"output column(s) {', '.join(clash)} already exist in the DataFrame; "
                "drop them or choose other names with setOutputCols([...])."
            )
        if len(names) != len(self._columns("label_cols")):
            raise ValueError(
                f"output_cols names {len(names)} column(s) but the model has "
                f"{len(self._columns('label_cols'))} output(s), one per label column."
            )
        label_kinds = self.getLabelKinds()
        if label_kinds is not None and len(label_kinds) != len(names):
            raise ValueError(
                f"label_kinds names {len(label_kinds)} kind(s) ({label_kinds}) but the model has "
                f"{len(names)} output(s); give one per label column with setLabelKinds([...])."
            )
        return framework

    def _refuse_foreign_params(self, framework: Framework) -> None:
        """A param only another framework's models read (a tokenizer on a plain torch
        model) is an error, not silently ignored."""
        found = foreign_param(
            framework, lambda f: dict.fromkeys(sorted(f.reads_model_params)), self.getOrDefault
        )
        if found is not None:
            owner, param, value = found
            raise ValueError(
                f"{param}={value!r} is set, but only a {owner.name} model reads it and "
                f"this RingModel holds a {framework.name} model "
                f"({type(self.getModel()).__name__}). Unset it (setParams({param}=None))."
            )

    def _transform(self, dataset: DataFrame) -> DataFrame:
        names, features = self._output_names(), self._columns("feature_cols")
        framework = self._check(dataset, names)
        # A feature column already as the model reads it (float, array<float>) is read
        # in place; others get a converted copy. Every column crosses to Python and back
        # (mapInArrow passes them through), so no column travels twice without need.
        fields, typed = [dataset.schema[c] for c in features], framework.typed_features
        staged = [
            f.name if is_staged_as_is(f, typed) else _STAGED.format(i) for i, f in enumerate(fields)
        ]
        copies = [
            feature_expr(f, s, typed) for f, s in zip(fields, staged, strict=True) if s != f.name
        ]
        inputs = dataset.select("*", *copies) if copies else dataset
        kinds, predict = self._predictor(framework, dataset, staged, names)
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
        self, framework: Framework, dataset: DataFrame, staged: list[str], names: list[str]
    ) -> tuple[list[DataType], Predictor]:
        """The output column types and the per-task ``mapInArrow`` function of the
        model's framework."""
        shapes = self._feature_shapes(dataset, self._columns("feature_cols"))
        params = {spec.name: self.getOrDefault(spec.name) for spec in MODEL_PARAMS}
        return framework.model_predictor(
            self.getModel(), shapes, staged, len(dataset.columns), names, self.getUseGpu(), params
        )
