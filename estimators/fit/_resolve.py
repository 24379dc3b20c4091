"""Step 1 of a fit: the estimator's params resolved into one checked ``FitConfig``.

:func:`resolve_config` reads every param, checks it (each error names the param, the
value seen and the setter that fixes it) and fills in the defaults that depend on the
session (``num_proc``), on chance (``random_seed``, ``run_id``) or on the disk
(``store``); no Spark job runs. In this order, the first failure raised: the model's
framework (from the registry) and the params it checks, the callbacks, the columns
against the DataFrame's schema (``_schema``), the numbers, the store; then a param that
only another framework reads is refused, and the model's framework resolves its own
(``Framework.resolve``); then which run this fit is (``store/_runs.py``: a ``run_id``
holding another fit's checkpoint is not resumed), what is sent to the workers pickles,
the store takes writes, the model fits the checkpoint it would resume
(``Framework.check_resume``); last, what the cluster must offer (``_cluster``: the task
slots, a Connect server that sees the store) and who writes the Parquet.
"""

from __future__ import annotations

import importlib.util
import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import cloudpickle
import torch
from pyspark.sql import DataFrame, SparkSession

from ringcore.data import POOL_TYPES, READERS, petastorm_problems, resolve_reader
from spark_runner import default_num_proc, is_connect

from .._callbacks import check_callbacks
from .._params import ESTIMATOR_PARAMS
from ..data._columns import label_kinds, text_columns
from ..data._parquet_writer import pick_writer
from ..frameworks._base import Framework
from ..frameworks._registry import foreign_param, framework_of
from ..store._default import default_store
from ..store._runs import run_params, run_to_use
from ..store._store import Store
from ._cluster import check_connect_store, check_slots, check_store_writable
from ._config import FitConfig
from ._schema import check_schema

__all__ = ["param_values", "refuse_foreign_params", "resolve_config"]


def _check_positive(name: str, value: Any, setter: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{name} must be a positive integer, got {value!r}. Set it with {setter}(...)."
        )


def _check_model(est: Any) -> Framework:
    """The model's framework (the registry's), after the params it checks."""
    model = est.getModel()
    if model is None:
        raise ValueError("model is not set; pass the model to train with setModel(...).")
    framework = framework_of(model)
    framework.check_params(model, est.getOptimizer(), _loss(est), est.getMetrics())
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


def param_values(est: Any) -> dict[str, Any]:
    """Every param of ``est``, None read as the param's default (Horovod passes None for
    a param it leaves unset)."""
    values = {}
    for spec in ESTIMATOR_PARAMS:
        value = est.getOrDefault(spec.name)
        values[spec.name] = spec.default if value is None else value
    return values


def refuse_foreign_params(values: Mapping[str, Any], framework: Framework) -> None:
    """A param that only another registered framework reads, set for a model of
    ``framework``, raises that framework's error (its loop is not the one that runs)."""
    found = foreign_param(framework, lambda f: f.params, values.__getitem__)
    if found is not None:
        owner, param, value = found
        raise ValueError(owner.refusal(param, value, framework))


def _check_pickles(name: str, value: Any, setter: str) -> None:
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        raise ValueError(
            f"{name} ({type(value).__name__}) cannot be pickled, so it cannot be sent to the "
            f"workers: {type(exc).__name__}: {exc}. Keep unpicklable state (locks, threads, open "
            "files, sockets, a SparkSession) out of it, e.g. create it lazily on first use or drop "
            f"it in __getstate__, then pass it again with {setter}(...)."
        ) from exc


def _check_config(cfg: FitConfig) -> None:
    """What a resolved config must hold before any job: what is sent to the workers
    pickles, the store takes writes, the model fits the checkpoint it would resume."""
    if cfg.framework.pickles_model:
        _check_pickles("model", cfg.model, "setModel")
    for name, setter in (
        ("loss", "setLoss"),
        ("metrics", "setMetrics"),
        ("transformation_fn", "setTransformationFn"),
        ("callbacks", "setCallbacks"),
    ):
        value = getattr(cfg, name, None)
        if value is not None:
            _check_pickles(name, value, setter)
    check_store_writable(cfg.store)
    path = cfg.store.find_checkpoint(cfg.run_id)
    if path is not None:
        cfg.framework.check_resume(cfg.model, cfg.store, cfg.run_id, path)


def resolve_config(
    est: Any, df: DataFrame | None, spark: SparkSession | None = None, *, slots: bool = False
) -> FitConfig:
    """Check every param of ``est`` (against ``df``'s schema when given) and resolve the
    defaults; starts no job. Without ``df`` (data already in the store) the caller
    checks the columns and ``validation`` must be a fraction. ``slots``: also wait for
    the cluster's task slots (the Spark launcher's)."""
    framework = _check_model(est)
    check_callbacks(est.getCallbacks())
    if df is not None:
        check_schema(est, df.schema)
        spark = df.sparkSession
    _check_numbers(est)
    cfg = _config(est, df, spark, framework)
    values = param_values(est)
    refuse_foreign_params(values, framework)
    cfg = replace(cfg, framework_config=framework.resolve(values, cfg))
    # a run_id holding another fit's checkpoint is not resumed (store/_runs.py)
    params = run_params(cfg, values, df)
    cfg = replace(cfg, run_id=run_to_use(cfg.store, cfg.run_id, params), run_params=params)
    _check_config(cfg)
    if spark is not None and slots:
        check_slots(spark, cfg.num_proc)
    if df is not None:
        if is_connect(df.sparkSession):
            check_connect_store(df.sparkSession, cfg.store)
        cfg = replace(cfg, parquet_writer=pick_writer(df.sparkSession, cfg.store))
    return cfg


def _config(
    est: Any, df: DataFrame | None, spark: SparkSession | None, framework: Framework
) -> FitConfig:
    """The generic config of ``est``'s params, its defaults filled in."""
    seed = est.getRandomSeed()
    num_proc = est.getNumProc()
    parallelism = default_num_proc(spark) if spark is not None and num_proc is None else 1
    return FitConfig(
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
        progress=est.getOrDefault("progress"),
        seed=seed if seed is not None else random.randrange(2**31),
        split_seed=seed,
        store=_resolve_store(est),
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
        use_gpu=_resolve_use_gpu(est.getUseGpu()),
        backend_env=dict(est.getOrDefault("backend_env") or {}),
        label_kinds=label_kinds(df.schema, est.getLabelCols()) if df is not None else None,
        text_cols=text_columns(df.schema, est.getFeatureCols()) if df is not None else [],
    )
