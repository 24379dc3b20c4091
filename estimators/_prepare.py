"""Data preparation for ``fit``: the DataFrame becomes balanced Parquet in the Store.

Petastorm shards by row group, so uneven files give ranks uneven data (seen:
6,264 vs 3,736 rows of 10,000 on two ranks). We therefore write ``num_proc`` files
with ``repartition(num_proc)`` (round-robin: equal to within a few rows), each a
single row group, and fix the steps per epoch from the row count so that every
rank runs the same number of steps.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import pyarrow.dataset as pads
from pyspark.sql import DataFrame

from ringcore.data import parquet_row_counts, resolve_reader, to_numpy_columns

from ._columns import feature_expr, label_expr
from ._config import FitConfig

log = logging.getLogger("ringtrain.estimators")

__all__ = ["PreparedData", "prepare_data"]


@dataclass(frozen=True)
class PreparedData:
    train_path: str
    val_path: str | None
    train_rows: int
    val_rows: int
    steps_per_epoch: int
    feature_shapes: list[list[int]]  # one row's shape per feature column


def _write(frame: DataFrame, url: str, num_proc: int) -> None:
    frame.repartition(num_proc).write.mode("errorifexists").parquet(url)


def _check_files(path: str, what: str, num_proc: int, reader: str) -> int:
    counts = parquet_row_counts(path)
    groups = [f.num_row_groups for f in pads.dataset(path, format="parquet").get_fragments()]
    rows = sum(counts)
    if rows < num_proc:
        raise ValueError(
            f"the {what} data has {rows} rows, fewer than num_proc={num_proc}: some process would "
            "have nothing to read. Give it more rows (a larger DataFrame or validation fraction) "
            "or lower num_proc."
        )
    if resolve_reader(reader) == "petastorm" and sum(groups) < num_proc:
        raise ValueError(
            f"the {what} data has {rows} rows in {sum(groups)} Parquet row groups, fewer than "
            f"num_proc={num_proc}, so petastorm would leave a process without data. Give it more "
            "rows (a larger DataFrame or validation fraction), lower num_proc, or set reader='arrow'."
        )
    if len(groups) != num_proc or max(groups, default=1) > 1:
        log.warning(
            "the %s data is in %d files with %s row groups; petastorm shards by row group, "
            "so processes read unequal amounts of data",
            what,
            len(groups),
            groups,
        )
    return rows


def _feature_shapes(path: str, feature_cols: list[str]) -> list[list[int]]:
    first = to_numpy_columns(
        pads.dataset(path, format="parquet").head(1, columns=feature_cols), feature_cols
    )
    return [list(first[c].shape[1:]) or [1] for c in feature_cols]


def _steps_per_epoch(cfg: FitConfig, train_rows: int) -> int:
    if cfg.train_steps_per_epoch is not None:
        return cfg.train_steps_per_epoch
    return max(1, train_rows // (cfg.batch_size * cfg.num_proc))


def prepare_data(df: DataFrame, cfg: FitConfig) -> PreparedData:
    """Select and flatten the columns, split off validation, write Parquet under the Store."""
    schema = df.schema
    selected = df.select(
        *[feature_expr(schema[c]) for c in cfg.feature_cols],
        *[label_expr(schema[c]) for c in cfg.label_cols],
    )
    if cfg.validation > 0:
        train_df, val_df = selected.randomSplit(
            [1.0 - cfg.validation, cfg.validation], seed=cfg.seed
        )
    else:
        train_df, val_df = selected, None
    idx = cfg.store.next_data_index()
    train_path = cfg.store.get_train_data_path(idx)
    _write(train_df, cfg.store.url(train_path), cfg.num_proc)
    train_rows = _check_files(train_path, "training", cfg.num_proc, cfg.reader)
    val_path, val_rows = None, 0
    if val_df is not None:
        val_path = cfg.store.get_val_data_path(idx)
        _write(val_df, cfg.store.url(val_path), cfg.num_proc)
        val_rows = _check_files(val_path, "validation", cfg.num_proc, cfg.reader)
    log.info(
        "wrote %d training and %d validation rows to %s",
        train_rows,
        val_rows,
        cfg.store.prefix_path,
    )
    return PreparedData(
        train_path=train_path,
        val_path=val_path,
        train_rows=train_rows,
        val_rows=val_rows,
        steps_per_epoch=_steps_per_epoch(cfg, train_rows),
        feature_shapes=_feature_shapes(train_path, cfg.feature_cols),
    )
