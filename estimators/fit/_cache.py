"""Prepared data is reused: a second fit on the same DataFrame into the same store
trains on the Parquet of the first, writing none.

The key is the DataFrame (its analyzed plan, ``df.semanticHash()``, and schema), the
columns, the validation, the seed, ``num_proc`` and the reader. The cache lives in the
driver process and trusts the plan: a file-based DataFrame whose files changed under
the same path is not noticed. The check step looks data up (:func:`cached_data`), the
write step remembers what it wrote (:func:`remember`).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pyspark.sql import DataFrame

from ringcore.data import resolve_reader

from ._config import FitConfig, PreparedData, steps_per_epoch

log = logging.getLogger("ringtrain.estimators")

__all__ = ["cached_data", "clear_cache", "remember"]

_CACHE: dict[tuple[Any, ...], PreparedData] = {}


def clear_cache() -> None:
    """Forget every prepared dataset (the Parquet stays in its store)."""
    _CACHE.clear()


def _cache_key(df: DataFrame, cfg: FitConfig) -> tuple[Any, ...]:
    return (
        repr(cfg.store),
        df.semanticHash(),
        df.schema.json(),
        tuple(cfg.feature_cols),
        tuple(cfg.label_cols),
        cfg.sample_weight_col,
        cfg.validation,
        cfg.split_seed,
        cfg.num_proc,
        cfg.partitions_per_process,
        resolve_reader(cfg.reader),
        cfg.framework.typed_features,  # integer features as int64, or as float32
    )


def cached_data(df: DataFrame, cfg: FitConfig) -> PreparedData | None:
    """What an earlier fit prepared from ``df`` with ``cfg``'s columns into its store,
    while it is still there (its steps per epoch this fit's)."""
    data = _CACHE.get(_cache_key(df, cfg))
    if data is None or not cfg.store.exists(data.train_path):
        return None
    if data.val_path is not None and not cfg.store.exists(data.val_path):
        return None
    log.info("reusing the prepared data %s", data.train_path)
    return dataclasses.replace(data, steps_per_epoch=steps_per_epoch(cfg, data.train_rows))


def remember(df: DataFrame, cfg: FitConfig, data: PreparedData) -> None:
    """Keep ``data`` for the next fit of ``df`` with ``cfg``'s columns."""
    _CACHE[_cache_key(df, cfg)] = data
