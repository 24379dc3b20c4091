"""Step 2 of a fit: the DataFrame checked once, and a first batch through the model.

One Spark job (:func:`check_data`): one aggregation over the selected columns counts the
rows, the nulls, the NaNs and the array lengths, and picks two rows. Nulls and NaNs can
only be found by reading the data, hence this one job; it writes nothing. Data an
earlier fit prepared from the same DataFrame (``_cache``) was checked then: its first
two rows stand in, read from its Parquet. Either way the rows go through the model's
framework (``Framework.check_first_batch``: the model and the loss on the driver), so a
shape mismatch fails here, naming both shapes, before any data is written.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, FractionalType, IntegralType, StringType

from ringcore.data import to_numpy_columns

from ..data._columns import read_columns, selected_columns, validation_marker
from ._cache import cached_data
from ._config import CheckedData, FitConfig

__all__ = ["check_data"]


def check_data(df: DataFrame, cfg: FitConfig) -> CheckedData:
    """The DataFrame checked (one job, or the cached data's first rows) and two rows
    through the model's framework; raises ValueError naming the column or the shapes."""
    cached = cached_data(df, cfg)
    batch = _first_rows(cfg, cached.train_path) if cached is not None else _scan(df, cfg)
    if batch is not None:
        cfg.framework.check_first_batch(cfg, batch)  # through the model and the loss
    return CheckedData(batch, cached)


def _first_rows(cfg: FitConfig, path: str) -> dict[str, Any]:
    columns = read_columns(cfg.feature_cols, cfg.label_cols, cfg.sample_weight_col)
    return to_numpy_columns(cfg.store.parquet_dataset(path).head(2, columns=columns), columns)


def _count(condition: Column) -> Column:
    return F.sum(F.when(condition, 1).otherwise(0))


_VAL = "__ringtrain_validation"


def _aggregations(frame: DataFrame, fields: list[Any], validation: bool) -> list[Column]:
    aggs = [F.count(F.lit(1)).alias("rows")]
    if validation:
        aggs.append(_count(F.col(_VAL)).alias("val_rows"))
    for i, field in enumerate(fields):
        col = F.col(f"`{field.name}`")
        if isinstance(field.dataType, ArrayType):
            aggs.append(_count(col.isNull() | F.exists(col, lambda x: x.isNull())).alias(f"n{i}"))
            aggs.append(_count(F.exists(col, lambda x: F.isnan(x))).alias(f"nan{i}"))
            aggs.append(F.min(F.size(col)).alias(f"min{i}"))
            aggs.append(F.max(F.size(col)).alias(f"max{i}"))
        else:
            aggs.append(_count(col.isNull()).alias(f"n{i}"))
            if isinstance(field.dataType, FractionalType):
                aggs.append(_count(F.isnan(col)).alias(f"nan{i}"))
    row = F.struct(*[F.col(f"`{f.name}`") for f in fields])
    return [*aggs, F.first(row).alias("first"), F.last(row).alias("last")]


def _raise_for_values(stats: dict[str, Any], selected: list[tuple[str, str, Column]]) -> None:
    for i, (role, name, _) in enumerate(selected):
        nulls = stats[f"n{i}"] or 0
        if nulls:
            array = f"min{i}" in stats
            drop = (
                f"df.filter(F.col({name!r}).isNotNull() & ~F.exists({name!r}, lambda v: v.isNull()))"
                if array
                else f"df.na.drop(subset=[{name!r}])"
            )
            raise ValueError(
                f"{role} column {name!r} of the training data has {nulls} null value(s) (rows "
                "with a null, or a null array element); models need a value in every row. Drop "
                f"those rows ({drop}) or fill them (df.na.fill(...)) before fit."
            )
        nans = stats.get(f"nan{i}") or 0
        if nans:
            raise ValueError(
                f"{role} column {name!r} has {nans} row(s) holding NaN; the loss would turn NaN. "
                f"Drop those rows (df.filter(~F.isnan({name!r})) for a scalar column) or replace "
                f"the NaNs (df.na.fill(0.0, subset=[{name!r}])) before fit."
            )
        low, high = stats.get(f"min{i}"), stats.get(f"max{i}")
        if low is not None and low != high:
            raise ValueError(
                f"{role} column {name!r} holds arrays of different lengths ({low} to {high}); a "
                "batch needs one length. Pad or cut them to one length (e.g. F.slice) before fit."
            )


def _raise_for_rows(stats: dict[str, Any], cfg: Any) -> None:
    rows = stats["rows"]
    needed = cfg.num_proc * cfg.batch_size
    if rows == 0:
        raise ValueError(
            f"the DataFrame is empty (0 rows); fit needs at least num_proc * batch_size = "
            f"{cfg.num_proc} * {cfg.batch_size} = {needed} training rows. Check the filter or "
            "join that produced it."
        )
    if isinstance(cfg.validation, str):
        train_rows, how = rows - (stats["val_rows"] or 0), ""
    else:  # a random split: the expected count (the workers' reader covers a few short)
        train_rows = int(rows * (1.0 - cfg.validation))
        how = "about " if cfg.validation else ""
    if train_rows < needed:
        raise ValueError(
            f"the training data has {how}{train_rows} rows, fewer than num_proc={cfg.num_proc} * "
            f"batch_size={cfg.batch_size} = {needed}, so a process would not get one full batch. "
            "Lower batch_size (setBatchSize) or num_proc (setNumProc), or give it more rows."
        )


def _batch_of(rows: list[Any], fields: list[Any]) -> dict[str, np.ndarray]:
    """``{column: ndarray}`` as the workers' readers give it (float32, int64, 2-D arrays,
    strings as objects)."""
    batch = {}
    for field in fields:
        values = [r[field.name] for r in rows]
        dtype = field.dataType
        inner = dtype.elementType if isinstance(dtype, ArrayType) else dtype
        if isinstance(inner, StringType):
            batch[field.name] = np.asarray(values, dtype=object)
            continue
        integral = isinstance(inner, IntegralType)
        batch[field.name] = np.asarray(values, dtype=np.int64 if integral else np.float32)
    return batch


def _scan(df: DataFrame, cfg: FitConfig) -> dict[str, np.ndarray] | None:
    """One Spark job over the columns fit reads: rows, nulls, NaNs, array lengths.
    Raises ValueError naming the column; returns two rows as a first batch."""
    selected = selected_columns(
        df.schema, cfg.feature_cols, cfg.label_cols, cfg.sample_weight_col,
        typed=cfg.framework.typed_features,
    )  # fmt: skip
    exprs = [expr for _, _, expr in selected]
    validation = isinstance(cfg.validation, str)
    if isinstance(cfg.validation, str):
        exprs.append(validation_marker(cfg.validation).alias(_VAL))
    frame = df.select(*exprs)
    fields = frame.schema.fields[: len(selected)]
    stats = frame.agg(*_aggregations(frame, fields, validation)).first()
    if stats is None:
        return None
    values = stats.asDict()
    _raise_for_rows(values, cfg)
    _raise_for_values(values, selected)
    return _batch_of([values["first"], values["last"]], fields)
