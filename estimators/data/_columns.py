"""Which DataFrame columns an estimator can train on, and how they become Parquet.

Features and labels may be numeric scalars, arrays of numbers or Spark ML Vectors.
Vectors and arrays become ``array<float>`` (one 2-D numpy array per batch on the
workers); scalar features become ``float``; scalar labels keep integers as
``bigint`` (class indices) and other numbers as ``float``. For a framework whose models
take typed inputs (``Framework.typed_features``: token ids) integer features keep
integers instead (``bigint``, ``array<bigint>``: int64 on the workers), and a text
feature column (strings, with ``tokenizer=``) stays a string column. :func:`label_kinds` records
what each label column was (``"scalar"``, ``"array"`` or ``"vector"``) so that
``RingModel.transform`` gives Vector outputs for Vector labels.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence

from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DateType,
    DecimalType,
    FloatType,
    FractionalType,
    IntegralType,
    LongType,
    MapType,
    NumericType,
    StringType,
    StructField,
    StructType,
    TimestampType,
)

__all__ = [
    "LABEL_KINDS",
    "check_columns",
    "feature_expr",
    "is_staged_as_is",
    "label_expr",
    "label_kinds",
    "read_columns",
    "selected_columns",
    "text_columns",
    "validation_marker",
]

_SUPPORTED = "numeric scalars, arrays of numbers and Spark ML Vectors"
LABEL_KINDS = ("scalar", "array", "vector")


def _is_number(dtype: DataType) -> bool:
    return isinstance(dtype, (NumericType, BooleanType))


def _supported(dtype: DataType) -> bool:
    if isinstance(dtype, VectorUDT) or _is_number(dtype):
        return True
    return isinstance(dtype, ArrayType) and _is_number(dtype.elementType)


def text_columns(schema: StructType, columns: Sequence[str]) -> list[str]:
    """The columns of ``columns`` that hold strings (text a tokenizer turns into ids)."""
    return [
        c
        for c in columns
        if c in schema.fieldNames() and isinstance(schema[c].dataType, StringType)
    ]


def check_columns(
    schema: StructType, columns: Sequence[str], role: str, setter: str, text: bool = False
) -> None:
    """Raise ValueError naming the first column of ``columns`` that ``schema`` lacks or
    cannot feed a model. ``role`` is e.g. "feature"; ``setter`` the param's setter;
    ``text``: string columns are taken too (a tokenizer is set)."""
    present = schema.fieldNames()
    for name in columns:
        if not isinstance(name, str) or name not in present:
            raise ValueError(
                f"{role} column {name!r} is not in the DataFrame; its columns are: "
                f"{', '.join(present)}.{_close_name(name, present)} Select or rename a column "
                f"to {name!r}, or pass existing names to {setter}(...)."
            )
        dtype = schema[name].dataType
        if not _supported(dtype) and not (text and isinstance(dtype, StringType)):
            raise ValueError(
                f"{role} column {name!r} has type {dtype.simpleString()}; ringtrain trains on "
                f"{_SUPPORTED}. {_conversion(name, dtype, setter)}"
            )


def _close_name(name: object, present: Sequence[str]) -> str:
    """`` Did you mean 'x'?`` for a misspelling (case or a few letters) of a present name."""
    if not isinstance(name, str):
        return ""
    lowered = {n.lower(): n for n in present}
    match = difflib.get_close_matches(name.lower(), list(lowered), n=1, cutoff=0.6)
    return f" Did you mean {lowered[match[0]]!r}?" if match else ""


def _conversion(name: str, dtype: DataType, setter: str) -> str:
    """How to turn a column of ``dtype`` into one ringtrain takes."""
    if isinstance(dtype, StructType):
        return (
            f"Select its fields as columns (df.select('*', '{name}.*')) and pass the numeric "
            f"ones to {setter}(...)."
        )
    if isinstance(dtype, MapType):
        return (
            f"Take the values you need out as numeric columns (F.col('{name}')['key']) and pass "
            f"those to {setter}(...)."
        )
    if isinstance(dtype, ArrayType):
        return (
            "Make it an array of numbers first (F.flatten for nested arrays, a cast or "
            "StringIndexer for strings)."
        )
    if isinstance(dtype, StringType) and setter == "setFeatureCols":
        return (
            "Convert it first (e.g. StringIndexer, or VectorAssembler over numeric columns), "
            f"then pass the new column to {setter}(...); a Hugging Face model tokenizes a "
            "text column on the workers instead: pass tokenizer= (a transformers tokenizer)."
        )
    if isinstance(dtype, (DateType, TimestampType)):
        return f"Make it a number first (e.g. F.unix_timestamp('{name}'))."
    return (
        "Convert it first (e.g. StringIndexer for labels, VectorAssembler for features), "
        f"then pass the new column to {setter}(...)."
    )


def _array_of_float(column: Column, dtype: DataType) -> Column:
    if isinstance(dtype, VectorUDT):
        return vector_to_array(column, "float32")
    return column.cast(ArrayType(FloatType()))


def _typed(dtype: DataType) -> DataType | None:
    """What a typed-features framework reads ``dtype`` as, where it keeps it: integers
    as ``bigint`` (arrays of them ``array<bigint>``), strings as they are; None: float."""
    if isinstance(dtype, StringType):
        return dtype
    if isinstance(dtype, IntegralType):
        return LongType()
    if isinstance(dtype, ArrayType) and isinstance(dtype.elementType, IntegralType):
        return ArrayType(LongType(), dtype.containsNull)
    return None


def feature_expr(field: StructField, name: str | None = None, typed: bool = False) -> Column:
    """``field`` as the workers read it: ``array<float>`` or ``float``, named ``name``
    (default: the field's name); ``typed``: integers and strings kept (:func:`_typed`)."""
    column = F.col(f"`{field.name}`")
    kept = _typed(field.dataType) if typed else None
    if kept is not None:
        return column.cast(kept).alias(name or field.name)
    if _is_number(field.dataType):
        return column.cast("float").alias(name or field.name)
    return _array_of_float(column, field.dataType).alias(name or field.name)


def is_staged_as_is(field: StructField, typed: bool = False) -> bool:
    """Whether :func:`feature_expr` leaves ``field`` as it is (``float`` or ``array<float>``;
    ``typed``: or what :func:`_typed` keeps), so a reader can take the column itself
    instead of a converted copy."""
    dtype = field.dataType
    if typed and _typed(dtype) is not None:
        return _typed(dtype) == dtype
    if isinstance(dtype, ArrayType):
        return isinstance(dtype.elementType, FloatType)
    return isinstance(dtype, FloatType)


def label_expr(field: StructField) -> Column:
    """``field`` as the workers read it: ``bigint`` for integers, else ``float`` /
    ``array<float>``, same name."""
    column = F.col(f"`{field.name}`")
    dtype = field.dataType
    if isinstance(dtype, IntegralType):
        return column.cast("bigint").alias(field.name)
    if isinstance(dtype, (FractionalType, DecimalType, BooleanType)):
        return column.cast("float").alias(field.name)
    return _array_of_float(column, dtype).alias(field.name)


def label_kinds(schema: StructType, columns: Sequence[str]) -> list[str]:
    """Per label column of ``schema``: ``"vector"`` (a Spark ML Vector), ``"array"`` or
    ``"scalar"`` — one of :data:`LABEL_KINDS`."""

    def kind(dtype: DataType) -> str:
        if isinstance(dtype, VectorUDT):
            return "vector"
        return "array" if isinstance(dtype, ArrayType) else "scalar"

    return [kind(schema[name].dataType) for name in columns]


def read_columns(feature_cols: list[str], label_cols: list[str], weight: str | None) -> list[str]:
    """The columns the workers read: features, labels, then the sample weight column if any."""
    return [*feature_cols, *label_cols, *([weight] if weight is not None else [])]


def selected_columns(
    schema: StructType,
    feature_cols: list[str],
    label_cols: list[str],
    weight: str | None,
    typed: bool = False,
) -> list[tuple[str, str, Column]]:
    """``(role, name, expression)`` of every column the workers read, as they read it
    (the expressions both the data check and the Parquet writer select)."""
    columns = [("feature", c, feature_expr(schema[c], typed=typed)) for c in feature_cols]
    columns += [("label", c, label_expr(schema[c])) for c in label_cols]
    if weight is not None:
        columns.append(("sample weight", weight, F.col(f"`{weight}`").cast("float").alias(weight)))
    return columns


def validation_marker(name: str) -> Column:
    """True on the validation rows of a validation column (null counts as training)."""
    return F.coalesce(F.col(f"`{name}`").cast("boolean"), F.lit(False))
