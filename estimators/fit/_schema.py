"""The params that name columns, checked against the DataFrame's schema (no job).

Features and labels are set, distinct, present and of a type a model can take
(``data/_columns.check_columns``: numbers, arrays of numbers, Spark ML Vectors); the
sample weight column is numeric, a validation column boolean or integer, neither one
also a feature or a label. Each error names the column, what it is and the setter.
"""

from __future__ import annotations

from typing import Any

from pyspark.sql.types import BooleanType, IntegralType, NumericType, StructType

from ..data._columns import check_columns, text_columns

__all__ = ["check_schema"]


def check_schema(est: Any, schema: StructType) -> None:
    """Every column param of ``est`` against ``schema`` (see the module docstring)."""
    features, labels = est.getFeatureCols(), est.getLabelCols()
    if not features:
        raise ValueError(
            "feature_cols is not set; name the input columns with setFeatureCols([...])."
        )
    if not labels:
        raise ValueError("label_cols is not set; name the label columns with setLabelCols([...]).")
    both = sorted(set(features) & set(labels))
    if both:
        raise ValueError(
            f"column(s) {', '.join(both)} are in both feature_cols and label_cols; use each once."
        )
    for cols, what in ((features, "feature_cols"), (labels, "label_cols")):
        dupes = sorted({c for c in cols if cols.count(c) > 1})
        if dupes:
            raise ValueError(f"{what} names {', '.join(dupes)} more than once.")
    tokenizer = est.getTokenizer()
    check_columns(schema, features, "feature", "setFeatureCols", text=tokenizer is not None)
    if tokenizer is not None and not text_columns(schema, features):
        raise ValueError(
            f"tokenizer={type(tokenizer).__name__} is set but no feature column holds text: "
            f"feature_cols {features} are {', '.join(schema[c].dataType.simpleString() for c in features)}. "
            "Add the string column to tokenize to feature_cols, or unset tokenizer "
            "(setTokenizer(None)) for columns of token ids."
        )
    check_columns(schema, labels, "label", "setLabelCols")
    _check_extra_columns(est, schema, set(features) | set(labels))


def _check_extra_columns(est: Any, schema: StructType, used: set[str]) -> None:
    """The sample weight column and a validation column: present, of a fitting type."""
    weight = est.getSampleWeightCol()
    if weight is not None:
        if weight in used:
            raise ValueError(f"sample_weight_col {weight!r} is also a feature or label column.")
        check_columns(schema, [weight], "sample weight", "setSampleWeightCol")
        if not isinstance(schema[weight].dataType, (NumericType, BooleanType)):
            raise ValueError(
                f"sample weight column {weight!r} has type "
                f"{schema[weight].dataType.simpleString()}; it takes one number per row. "
                "Set setSampleWeightCol to a numeric column."
            )
    validation = est.getValidation()
    if isinstance(validation, str):
        if validation in used or validation == weight:
            raise ValueError(f"validation column {validation!r} is also a feature/label/weight.")
        check_columns(schema, [validation], "validation", "setValidation")
        dtype = schema[validation].dataType
        if not isinstance(dtype, (BooleanType, IntegralType)):
            raise ValueError(
                f"validation column {validation!r} has type {dtype.simpleString()}; it must be "
                "boolean or integer (true / non-zero on validation rows). Pass a column like "
                "that, or a fraction such as setValidation(0.1)."
            )
