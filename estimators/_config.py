"""An estimator's params checked against the DataFrame, before any Spark job starts.

:func:`resolve_config` reads every param, checks it (each error names the param,
the value seen and the setter that fixes it) and fills in the defaults that depend
on the session (``num_proc``), on chance (``random_seed``, ``run_id``) or on the
disk (``store``), returning one frozen :class:`FitConfig` for the rest of ``fit``.
The checks run in this order, and the first failure is raised: the model and the
params its framework checks (``_frameworks.get_framework(...).check_params``), the
callbacks, the columns against the schema, the numbers, the store, then what
``_checks.check_config`` checks (pickling, a writable store, a reused run_id).
"""

from __future__ import annotations

import importlib.util
import random
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql.types import BooleanType, IntegralType, NumericType, StructType

from ringcore.data import POOL_TYPES, READERS, petastorm_problems, resolve_reader
from spark_runner import default_num_proc

from ._callbacks import check_callbacks
from ._checks import check_config
from ._columns import check_columns, label_kinds
from ._frameworks import framework_of, get_framework
from ._knobs import TrainingKnobs, resolve_knobs
from ._lightning import lightning_values
from ._runs import run_params, run_to_use
from ._store import Store, default_store

__all__ = ["FitConfig", "resolve_config"]


@dataclass(frozen=True)
class FitConfig:
    framework: str  # _frameworks.FRAMEWORKS: what model is (get_framework's key)
    model: Any
    optimizer: Any  # a torch.optim.Optimizer; None for a LightningModule
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
    callbacks: list[Any]  # torch: objects with on_epoch_end / on_batch_end (_callbacks.py)
    use_gpu: bool  # resolved: the use_gpu param, or whether CUDA is present
    run_params: dict[str, Any] = field(default_factory=dict)  # what it trains (_runs.py)
    label_kinds: list[str] | None = None  # per label column, as in the DataFrame (_columns)
    knobs: TrainingKnobs = field(default_factory=lambda: TrainingKnobs())  # _knobs.py


def _check_positive(name: str, value: Any, setter: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive integer, got {value!r}. Set it with {setter}(...)."
        )


def _check_model(est: Any) -> str:
    """Check the model and the params its framework checks; returns the framework's name."""
    model = est.getModel()
    if model is None:
        raise ValueError("model is not set; pass the model to train with setModel(...).")
    framework = framework_of(model)
    get_framework(framework).check_params(model, est.getOptimizer(), _loss(est), est.getMetrics())
    return framework


def _loss(est: Any) -> Any:
    """The loss param, or (Horovod's ``loss_constructors``) the first one constructed."""
    makers = est.getLossConstructors()
    if est.getLoss() is not None or not makers:
        return est.getLoss()
    try:
        return makers[0]()
    except Exception as exc:
        raise ValueError(
            f"loss_constructors[0] raised {type(exc).__name__}: {exc}; each takes no arguments "
            "and returns a loss fn(output, label). Fix it and pass it with setLossConstructors."
        ) from exc


def _check_columns(est: Any, schema: StructType) -> None:
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
    check_columns(schema, features, "feature", "setFeatureCols")
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


def _check_pool(pool: Any, reader: str) -> None:
    """``reader_pool_type`` against the reader it will drive (before any job)."""
    if pool not in POOL_TYPES:
        raise ValueError(
            f"reader_pool_type must be one of {', '.join(map(repr, POOL_TYPES))}; got "
            f"{pool!r}. Set it with setReaderPoolType('thread') (the default), for example."
        )
    if pool != "process" or reader not in READERS:
        return
    if resolve_reader(reader) != "petastorm":
        raise ValueError(
            f"reader_pool_type='process' is petastorm's process pool, but reader={reader!r} "
            "reads with arrow here, which reads ahead in threads: use "
            "setReaderPoolType('thread') (or 'dummy'), or setReader('petastorm')."
        )
    if importlib.util.find_spec("zmq") is None:
        raise ValueError(
            "reader_pool_type='process' needs pyzmq (petastorm's process pool talks to its "
            "workers through it), which is not installed: pip install pyzmq, or "
            "setReaderPoolType('thread')."
        )


def _check_numbers(est: Any) -> None:
    for name, setter, optional in (
        ("batch_size", "setBatchSize", False),
        ("val_batch_size", "setValBatchSize", True),
        ("epochs", "setEpochs", False),
        ("num_proc", "setNumProc", True),
        ("train_steps_per_epoch", "setTrainStepsPerEpoch", True),
        ("validation_steps_per_epoch", "setValidationStepsPerEpoch", True),
        ("train_reader_num_workers", "setTrainReaderNumWorkers", False),
        ("val_reader_num_workers", "setValReaderNumWorkers", False),
        ("partitions_per_process", "setPartitionsPerProcess", False),
        ("backward_passes_per_step", "setBackwardPassesPerStep", False),
    ):
        _check_positive(name, est.getOrDefault(name), setter, optional)
    validation = est.getValidation()
    if not isinstance(validation, str) and not 0.0 <= validation < 1.0:
        raise ValueError(
            f"validation is the fraction of rows held out, in [0, 1); got {validation}. "
            "Set it with setValidation(0.1), for example."
        )
    if est.getReader() not in READERS:
        raise ValueError(f"reader must be one of {', '.join(READERS)}; got {est.getReader()!r}.")
    _check_pool(est.getReaderPoolType(), est.getReader())
    if est.getReader() == "petastorm":
        problems = petastorm_problems()
        if problems:
            raise ValueError(
                f"reader='petastorm' cannot work here: {'; '.join(problems)}. Use "
                "setReader('arrow') (or 'auto', which picks arrow on this stack)."
            )


def _resolve_use_gpu(use_gpu: bool | None) -> bool:
    """``None`` (the default) → whether this driver sees CUDA; ``True`` needs CUDA."""
    if use_gpu is None:
        return torch.cuda.is_available()
    if use_gpu and not torch.cuda.is_available():
        raise ValueError(
            "use_gpu=True but torch sees no CUDA device here; install a CUDA build of torch "
            "or leave use_gpu unset (auto) / setUseGpu(False)."
        )
    return bool(use_gpu)


def _default_run_id() -> str:
    return f"run_{time.strftime('%Y%m%d_%H%M%S')}_{uuid.uuid4().hex[:6]}"


def _resolve_store(est: Any) -> Store:
    # none given: a temporary directory here, a Unity Catalog volume on Databricks
    store = est.getStore() or default_store()
    if not store.spark_can_write:
        raise ValueError(
            f"the store {store.prefix_path} lives in the driver's memory, which the Spark workers "
            "(other processes) cannot read. Use a store every worker reaches: a shared "
            "directory, file://, s3://, gs://, hdfs://, abfs:// or dbfs:/."
        )
    return store


def resolve_config(est: Any, df: DataFrame | None, spark: SparkSession | None = None) -> FitConfig:
    """Check every param of ``est`` (against ``df``'s schema when given) and resolve the
    defaults; starts no job. Without ``df`` (data already in the store) the caller
    checks the columns and ``validation`` must be a fraction."""
    framework = _check_model(est)
    check_callbacks(est.getCallbacks())
    if df is not None:
        _check_columns(est, df.schema)
        spark = df.sparkSession
    _check_numbers(est)
    seed = est.getRandomSeed()
    store = _resolve_store(est)
    num_proc = est.getNumProc()
    parallelism = default_num_proc(spark) if spark is not None and num_proc is None else 1
    use_gpu = _resolve_use_gpu(est.getUseGpu())
    cfg = FitConfig(
        framework=framework,
        model=est.getModel(),
        optimizer=est.getOptimizer(),
        loss=est.getLoss(),
        metrics=list(est.getMetrics()),
        feature_cols=list(est.getFeatureCols()),
        label_cols=list(est.getLabelCols()),
        validation=est.getValidation(),
        sample_weight_col=est.getSampleWeightCol(),
        transformation_fn=est.getTransformationFn(),
        batch_size=est.getBatchSize(),
        val_batch_size=est.getValBatchSize() or est.getBatchSize(),
        epochs=est.getEpochs(),
        shuffle=est.getShuffle(),
        verbose=est.getVerbose(),
        seed=seed if seed is not None else random.randrange(2**31),
        split_seed=seed,
        store=store,
        run_id=est.getRunId() or _default_run_id(),
        num_proc=num_proc or parallelism,
        train_steps_per_epoch=est.getTrainStepsPerEpoch(),
        validation_steps_per_epoch=est.getValidationStepsPerEpoch(),
        reader=est.getReader(),
        reader_workers=est.getTrainReaderNumWorkers(),
        val_reader_workers=est.getValReaderNumWorkers(),
        reader_pool=est.getReaderPoolType(),
        partitions_per_process=est.getPartitionsPerProcess(),
        inmemory_cache_all=est.getInmemoryCacheAll(),
        backward_passes_per_step=est.getBackwardPassesPerStep(),
        callbacks=list(est.getCallbacks()),
        use_gpu=use_gpu,
        label_kinds=label_kinds(df.schema, est.getLabelCols()) if df is not None else None,
        knobs=resolve_knobs(est, framework, use_gpu),
    )
    # a run_id holding another fit's checkpoint is not resumed; trainer_args (Lightning's
    # precision, clipping, ...) change what is trained, so they count too
    params = run_params(cfg, df, lightning_values(est)["trainer_args"])
    cfg = replace(cfg, run_id=run_to_use(store, cfg.run_id, params), run_params=params)
    check_config(cfg)  # pickling, a writable store, a reused run_id (_checks.py)
    return cfg
