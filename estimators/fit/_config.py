"""The values a fit's steps hand on: its config, the first batch, the prepared data.

Configuration has three layers, one name each:

- **params**: the estimator's Spark ML params (``estimators/_params.py``, one table),
  what the user sets; Spark ML copies, saves and loads them;
- **config**: :class:`FitConfig`, the params of one fit resolved and checked on the
  driver (defaults filled in, the model's framework found), frozen; the part only the
  model's framework reads is ``framework_config``, which that framework resolves from
  its own params (``Framework.resolve``: ``TorchConfig``, ``LightningConfig``,
  ``KerasConfig``);
- **spec**: what crosses to the workers, plain picklable data: the data half every
  framework shares (``estimators/data/_spec.py``: ``DataSpec``) and the framework's own
  fields (``TorchSpec``, ``LightningSpec``, ``KerasSpec``).

Params stay as Spark ML needs them; a config is what the driver decides before any job;
a spec is what a worker may see (no SparkSession, no estimator).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..frameworks._base import Framework
from ..store._store import Store

__all__ = ["CheckedData", "FitConfig", "PreparedData", "steps_per_epoch"]


@dataclass(frozen=True)
class FitConfig:
    framework: Framework  # the model's, from the registry: it checks, trains and loads
    model: Any
    optimizer: Any  # None where the model brings its own (a LightningModule)
    loss: Any
    metrics: list[Any]
    feature_cols: list[str]
    label_cols: list[str]
    validation: float | str  # a fraction, or the column marking validation rows
    sample_weight_col: str | None
    transformation_fn: Any
    batch_size: int
    val_batch_size: int
    epochs: int
    shuffle: bool
    verbose: int
    progress: bool  # the progress param (RING_PROGRESS=0 turns it off everywhere)
    seed: int
    split_seed: int | None  # random_seed as set (None: unset), for the prepared-data cache
    store: Store
    run_id: str
    num_proc: int
    train_steps_per_epoch: int | None
    validation_steps_per_epoch: int | None
    reader: str
    reader_workers: int
    inmemory_cache_all: bool
    val_reader_workers: int
    reader_pool: str  # reader_pool_type
    partitions_per_process: int
    backward_passes_per_step: int
    callbacks: list[Any]
    use_gpu: bool  # resolved: the use_gpu param, or whether CUDA is present
    backend_env: dict[str, str] = field(default_factory=dict)  # set in every worker
    parquet_writer: str = "spark"  # who writes the Parquet (data/_parquet_writer.py)
    run_params: dict[str, Any] = field(default_factory=dict)  # what it trains (store/_runs.py)
    label_kinds: list[str] | None = None  # per label column, as in the DataFrame (data/_columns)
    text_cols: list[str] = field(default_factory=list)  # feature columns of strings (tokenizer=)
    framework_config: Any = None  # the framework's own part (Framework.resolve)


@dataclass(frozen=True)
class CheckedData:
    """What checking the DataFrame found: two rows as a first batch (None: no rows to
    show), and the data an earlier fit prepared from the same DataFrame, if any."""

    batch: dict[str, Any] | None
    cached: PreparedData | None


@dataclass(frozen=True)
class PreparedData:
    train_path: str
    val_path: str | None
    train_rows: int
    val_rows: int
    steps_per_epoch: int
    feature_shapes: list[list[int]]  # one row's shape per feature column


def steps_per_epoch(cfg: FitConfig, train_rows: int) -> int:
    """``train_steps_per_epoch``, else the full batches every process gets."""
    if cfg.train_steps_per_epoch is not None:
        return cfg.train_steps_per_epoch
    return max(1, train_rows // (cfg.batch_size * cfg.num_proc))
