"""What a training worker gets from the driver: the data-path half shared by every framework.

:class:`DataSpec` holds the columns, the prepared Parquet, the batching and the run's store;
each framework's spec adds its model's own fields (``TorchSpec``, ``LightningSpec``,
``KerasSpec``: all keyword-only, picklable data). :func:`data_spec_fields` fills the
data half from a fit's config and prepared data; :func:`writer` is the checkpoint writer
a worker claims the run with and writes as.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

from spark_runner import ATTEMPT_ENV_VAR

from ..store._store import Store

__all__ = ["DataSpec", "data_spec_fields", "writer"]


@dataclass(frozen=True, kw_only=True)
class DataSpec:
    """The data a worker reads and how: every field is picklable (no SparkSession)."""

    feature_cols: list[str]
    label_cols: list[str]
    train_path: str
    val_path: str | None
    batch_size: int
    val_batch_size: int
    epochs: int
    steps_per_epoch: int
    val_steps: int | None
    shuffle: bool
    seed: int
    reader: str
    reader_workers: int
    backward_passes_per_step: int
    store: Store
    run_id: str
    sample_weight_col: str | None = None  # per-row weights of the loss
    transformation_fn: Any = None  # fn(batch) -> batch, on every batch
    val_reader_workers: int = 1  # val_reader_num_workers
    reader_pool: str = "thread"  # reader_pool_type
    fit_token: int = 0  # the driver's time_ns() as the fit started: orders fits of one run


def writer(spec: DataSpec) -> tuple[int, int]:
    """This task's checkpoint writer, ``(fit, Spark stage attempt)`` (see
    :meth:`Store.claim_run`): a later fit, or a later attempt of one, is newer."""
    return spec.fit_token, int(os.environ.get(ATTEMPT_ENV_VAR, "0"))


def data_spec_fields(cfg: Any, data: Any) -> dict[str, Any]:
    """The :class:`DataSpec` fields from a ``FitConfig`` and its ``PreparedData``."""
    return {
        "feature_cols": cfg.feature_cols,
        "label_cols": cfg.label_cols,
        "train_path": data.train_path,
        "val_path": data.val_path,
        "batch_size": cfg.batch_size,
        "val_batch_size": cfg.val_batch_size,
        "epochs": cfg.epochs,
        "steps_per_epoch": data.steps_per_epoch,
        "val_steps": cfg.validation_steps_per_epoch,
        "shuffle": cfg.shuffle,
        "seed": cfg.seed,
        "reader": cfg.reader,
        "reader_workers": cfg.reader_workers,
        "val_reader_workers": cfg.val_reader_workers,
        "reader_pool": cfg.reader_pool,
        "backward_passes_per_step": cfg.backward_passes_per_step,
        "store": cfg.store,
        "run_id": cfg.run_id,
        "sample_weight_col": cfg.sample_weight_col,
        "transformation_fn": cfg.transformation_fn,
        "fit_token": time.time_ns(),
    }
