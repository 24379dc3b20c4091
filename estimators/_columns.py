"""Which DataFrame columns an estimator can train on, and how they become Parquet.

Features and labels may be numeric scalars, arrays of numbers or Spark ML Vectors.
Vectors and arrays become ``array<float>`` (one 2-D numpy array per batch on the
workers); scalar features become ``float``; scalar labels keep integers as
``bigint`` (class indices) and other numbers as ``float``.
"""

from __future__ import annotations

from collections.abc import Sequence

from pyspark.ml.functions import vector_to_array
from pyspark.ml.linalg import VectorUDT
from pyspark.sql import Column
from pyspark.sql import functions as F
from pyspark.sql.types import (
    ArrayType,
    BooleanType,
    DataType,
    DecimalType,
    FloatType,
    FractionalType,
    IntegralType,
    NumericType,
    StructField,
    StructType,
)

__all__ = ["check_columns", "feature_expr", "label_expr"]

_SUPPORTED = "numeric scalars, arrays of numbers and Spark ML Vectors"


def _is_number(dtype: DataType) -> bool:
    return isinstance(dtype, (NumericType, BooleanType))


def _supported(dtype: DataType) -> bool:
    if isinstance(dtype, VectorUDT) or _is_number(dtype):
        return True
    return isinstance(dtype, ArrayType) and _is_number(dtype.elementType)


def check_columns(schema: StructType, columns: Sequence[str], role: str, setter: str) -> None:
    """Raise ValueError naming the first column of ``columns`` that ``schema`` lacks or
    cannot feed a model. ``role`` is e.g. "feature"; ``setter`` the param's setter."""
    present = schema.fieldNames()
    for name in columns:
        if name not in present:
            raise ValueError(
                f"{role} column {name!r} is not in the DataFrame; its columns are: "
                f"{', '.join(present)}. Select or rename a column to {name!r}, or pass "
                f"existing names to {setter}([...])."
            )
        dtype = schema[name].dataType
        if not _supported(dtype):
            raise ValueError(
                f"{role} column {name!r} has type {dtype.simpleString()}; ringtrain trains on "
                f"{_SUPPORTED}. Convert it first (e.g. StringIndexer for labels, "
                "VectorAssembler for features)."
            )


def _array_of_float(column: Column, dtype: DataType) -> Column:
    if isinstance(dtype, VectorUDT):
        return vector_to_array(column, "float32")
    return column.cast(ArrayType(FloatType()))


def feature_expr(field: StructField, name: str | None = None) -> Column:
    """``field`` as the workers read it: ``array<float>`` or ``float``, named ``name``
    (default: the field's name)."""
    column = F.col(f"`{field.name}`")
    if _is_number(field.dataType):
        return column.cast("float").alias(name or field.name)
    return _array_of_float(column, field.dataType).alias(name or field.name)


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
