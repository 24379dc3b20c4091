"""``RingEstimator``: data-parallel training of a torch model as a Spark ML ``Estimator``.

``fit(df)`` follows DESIGN.md's data path: check the params against ``df.schema``
(before any job), write the data as balanced Parquet under the Store, run
:func:`estimators._train_torch.train` on ``num_proc`` Spark tasks through the
``launcher`` (``spark_runner.run``), print the metrics of each epoch, and load the
final checkpoint into a :class:`RingModel`.
"""

from __future__ import annotations

import copy
import io
import posixpath
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
from pyspark.ml import Estimator
from pyspark.sql import DataFrame, SparkSession

from ._checks import check_slots, launch
from ._columns import label_kinds
from ._config import FitConfig, resolve_config
from ._frameworks import KERAS, LIGHTNING
from ._mlflow import log_to_mlflow
from ._model import RingModel
from ._params import (
    ESTIMATOR_PARAMS,
    HOROVOD_ONLY_PARAMS,
    GeneratedAccessors,
    checked_params,
    init_params,
    with_horovod_params,
    with_params,
)
from ._prepare import PreparedData, describe_parquet, prepare_data
from ._report import HistoryPrinter
from ._spec import data_spec_fields
from ._store import TRAIN_DATA, VAL_DATA, Store
from ._train_torch import TrainSpec, as_outputs, train

__all__ = ["RingEstimator"]


def spark_launcher(fn: Callable[..., Any], args: tuple, num_proc: int) -> list[Any]:
    """Run ``fn(*args)`` on ``num_proc`` tasks of one Spark barrier stage."""
    import spark_runner

    return spark_runner.run(fn, args=args, num_proc=num_proc)


def _optimizer_groups(model: torch.nn.Module, optimizer: Any) -> list[list[int]]:
    if optimizer is None:  # a LightningModule: configure_optimizers() on every worker
        return []
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _train_spec(cfg: FitConfig, data: PreparedData) -> TrainSpec:
    optimizer_cls = type(cfg.optimizer) if cfg.optimizer is not None else None
    return TrainSpec(
        user_objects=cloudpickle.dumps(
            (cfg.model, optimizer_cls, cfg.loss, cfg.metrics, cfg.callbacks)
        ),
        optimizer_groups=_optimizer_groups(cfg.model, cfg.optimizer),
        optimizer_state=cfg.optimizer.state_dict() if cfg.optimizer is not None else {},
        **data_spec_fields(cfg, data),
        framework=cfg.framework,
        use_gpu=cfg.use_gpu,
        inmemory_cache_all=cfg.inmemory_cache_all,
    )


def probe_torch_model(model: torch.nn.Module, shapes: list[list[int]], outputs: int) -> None:
    """Run the model once on the driver, on two all-zero rows of the features' shapes,
    so that a model that does not fit the data fails here with the shapes named, not
    as a traceback from inside the Spark tasks."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            result = model(*[torch.zeros(2, *shape) for shape in shapes])
        as_outputs(result, outputs)
    except Exception as exc:
        raise ValueError(
            f"the model fails on a batch of the feature columns' shapes "
            f"{[[2, *s] for s in shapes]} (float32; rows first): {type(exc).__name__}: {exc}. "
            "Make its input layer match the features, or fix feature_cols."
        ) from exc
    finally:
        model.train(was_training)


def _worker(cfg: FitConfig, data: PreparedData) -> tuple[Callable[..., Any], tuple]:
    """The function every worker runs, and its arguments, for the model's framework
    (``cfg.framework``, from ``_frameworks.framework_of``)."""
    if cfg.framework == KERAS:  # Keras: its own loop (_train_keras.py)
        from ._train_keras import keras_worker

        return keras_worker(cfg, data)
    # torch nn.Module and LightningModule share the torch loop (_train_torch.py).
    return train, (_train_spec(cfg, data),)


def _check_parquet_columns(cfg: FitConfig, paths: list[str]) -> None:
    """Data already in the store must exist and hold every column the params name."""
    wanted = cfg.feature_cols + cfg.label_cols
    if cfg.sample_weight_col is not None:
        wanted.append(cfg.sample_weight_col)
    for path in paths:
        if not cfg.store.exists(path):
            raise ValueError(
                f"no Parquet data at {path}; pass paths inside the store {cfg.store.prefix_path}, "
                "e.g. store.get_train_data_path(0) of an earlier fit."
            )
        present = cfg.store.parquet_dataset(path).schema.names
        missing = [c for c in wanted if c not in present]
        if missing:
            raise ValueError(
                f"the Parquet data at {path} has no column(s) {', '.join(missing)}; its columns "
                f"are: {', '.join(present)}. Set feature_cols / label_cols to columns it has."
            )


def _activate(spark: SparkSession) -> None:
    """Make ``spark`` this thread's active session when the thread has none:
    ``CrossValidator`` fits in pool threads, where ``spark_runner.run`` would find none."""
    if SparkSession.getActiveSession() is None:
        jvm = spark.sparkContext._jvm
        assert jvm is not None
        jvm.SparkSession.setActiveSession(spark._jsparkSession)


def _horovod_paths(store: Store, dataset_idx: int | None) -> tuple[str, str | None]:
    """Horovod's ``fit_on_parquet(dataset_idx=...)``: the training and (when present)
    validation data of that index in the store; None reads the unnumbered
    ``intermediate_train_data`` / ``intermediate_val_data`` (Horovod's default)."""
    if dataset_idx is None:
        train = posixpath.join(store.prefix_path, TRAIN_DATA)
        val = posixpath.join(store.prefix_path, VAL_DATA)
    else:
        if isinstance(dataset_idx, bool) or not isinstance(dataset_idx, int) or dataset_idx < 0:
            raise ValueError(f"dataset_idx must be an integer >= 0 or None, got {dataset_idx!r}")
        train, val = store.get_train_data_path(dataset_idx), store.get_val_data_path(dataset_idx)
    if not store.exists(train):
        count = store.next_data_index()
        held = f"indices 0..{count - 1}" if count else "no prepared data"
        raise ValueError(
            f"fit_on_parquet(dataset_idx={dataset_idx!r}) found no training data at {train}; "
            f"the store {store.prefix_path} holds {held}. Pass the dataset_idx an earlier fit "
            "or prepare step wrote, or train_path= to read Parquet from another path."
        )
    return train, (val if store.exists(val) else None)


@with_horovod_params(HOROVOD_ONLY_PARAMS)
@with_params(ESTIMATOR_PARAMS)
class RingEstimator(GeneratedAccessors, Estimator):
    """Train a torch ``nn.Module`` on a Spark DataFrame with ``num_proc`` workers.

    Params (each with a generated ``getX`` / ``setX``) are listed in
    ``estimators._params.ESTIMATOR_PARAMS``; pass them as keyword arguments.
    """

    #: The seam that starts the workers: ``launcher(fn, args, num_proc) -> results by rank``.
    launcher: Callable[[Callable[..., Any], tuple, int], list[Any]] = staticmethod(spark_launcher)

    def __init__(self, **kwargs: Any):
        super().__init__()
        init_params(self, ESTIMATOR_PARAMS, kwargs)

    def setParams(self, **kwargs: Any) -> RingEstimator:
        """Set several params at once, as the constructor's keywords (Horovod's ``setParams``)."""
        return self._set(**checked_params(self, ESTIMATOR_PARAMS, kwargs))

    def copy(self, extra: Any = None) -> RingEstimator:
        """An independent estimator (Spark ML ``copy``): ``extra`` params applied, and the
        model and optimizer deep-copied together (the copy's optimizer drives the copy's
        model), so fitting or changing one leaves the other as it was."""
        that = super().copy(extra)
        if that.isSet("model"):
            model, optimizer = copy.deepcopy((that.getModel(), that.getOrDefault("optimizer")))
            that._set(model=model)
            if that.isSet("optimizer"):
                that._set(optimizer=optimizer)
        return that

    def _fit(self, dataset: DataFrame) -> RingModel:
        _activate(dataset.sparkSession)
        cfg = resolve_config(self, dataset)
        if self.launcher is spark_launcher:
            check_slots(dataset.sparkSession, cfg.num_proc)  # before the data is written
        model = self._train(cfg, prepare_data(dataset, cfg))
        # Vector labels give Vector outputs (RingModel.transform); Parquet keeps only arrays
        return model.setLabelKinds(label_kinds(dataset.schema, cfg.label_cols))

    def fit_on_parquet(
        self,
        train_path: str | dict | None = None,
        val_path: str | int | None = None,
        params: dict | None = None,
        *,
        dataset_idx: int | None = None,
    ) -> RingModel:
        """Train on Parquet already in the store, without a DataFrame.

        Two call shapes: ours, ``fit_on_parquet(train_path, val_path=None, params=None)``
        with paths inside the store (e.g. ``store.get_train_data_path(0)`` written by an
        earlier ``fit``); and Horovod's, ``fit_on_parquet(params=None, dataset_idx=None)``
        (also positionally, ``fit_on_parquet({...}, 0)``), which reads
        ``intermediate_train_data.<dataset_idx>`` of the ``store`` param and its
        validation data when present (``dataset_idx=None``: the unnumbered
        ``intermediate_train_data``). ``params`` overrides params as in ``fit``; the
        ``validation`` param is not used here.
        """
        if isinstance(train_path, dict):  # Horovod's positional fit_on_parquet(params, idx)
            if params is not None:
                raise TypeError("fit_on_parquet got params twice (positionally and by name)")
            params, train_path = train_path, None
            if val_path is not None:
                if dataset_idx is not None:
                    raise TypeError("fit_on_parquet got dataset_idx twice")
                dataset_idx, val_path = val_path, None  # type: ignore[assignment]
        if train_path is not None and dataset_idx is not None:
            raise ValueError(
                f"fit_on_parquet got train_path={train_path!r} and dataset_idx={dataset_idx!r}; "
                "pass one: a path, or the index of data prepared in the store"
            )
        if val_path is not None and not isinstance(val_path, str):
            raise TypeError(f"val_path must be a path in the store, got {val_path!r}")
        est = self.copy(params) if params else self
        if train_path is None:
            if not est.isSet("store") or est.getStore() is None:
                raise ValueError(
                    "fit_on_parquet without train_path reads the data prepared in the store, "
                    "but no store is set; pass store=Store.create(prefix) (the prefix the data "
                    "was written under), or train_path=..."
                )
            train_path, val_path = _horovod_paths(est.getStore(), dataset_idx)
        cfg = resolve_config(est, None, SparkSession.getActiveSession())
        paths = [train_path] + ([val_path] if val_path is not None else [])
        _check_parquet_columns(cfg, paths)
        return est._train(cfg, describe_parquet(cfg, train_path, val_path))

    def _train(self, cfg: FitConfig, data: PreparedData) -> RingModel:
        if cfg.framework == LIGHTNING:  # torch models: _checks.check_first_batch
            probe_torch_model(cfg.model, data.feature_shapes, len(cfg.label_cols))
        fn, args = _worker(cfg, data)
        with HistoryPrinter(cfg.store, cfg.run_id, cfg.epochs, enabled=cfg.verbose >= 1) as printer:
            history = launch(self.launcher, fn, args, cfg)[0]  # explains store failures
            printer.finish(history)
        log_to_mlflow(cfg, history)
        return self._load_model(cfg, data, history)

    def _load_model(
        self, cfg: FitConfig, data: PreparedData, history: list[dict[str, Any]]
    ) -> RingModel:
        """The trained model from the run's final checkpoint, for the model's framework."""
        return RingModel(
            model=_load_keras_model(cfg) if cfg.framework == KERAS else _load_torch_model(cfg),
            history=history,
            run_id=cfg.run_id,
            feature_cols=cfg.feature_cols,
            label_cols=cfg.label_cols,
            output_cols=[f"{label}__output" for label in cfg.label_cols],
            feature_shapes=data.feature_shapes,
            store=cfg.store,
            use_gpu=self.getUseGpu(),  # as set (None: auto), so transform decides per task
        )


def _load_keras_model(cfg: FitConfig) -> Any:  # Keras: the checkpoint is a .keras file
    from ._train_keras import load_keras_checkpoint

    return load_keras_checkpoint(cfg)


def _load_torch_model(cfg: FitConfig) -> torch.nn.Module:
    raw = cfg.store.read_bytes(cfg.store.get_checkpoint_path(cfg.run_id))
    # map_location: a checkpoint of an older run may hold CUDA tensors; the driver may have no GPU
    checkpoint = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    model = copy.deepcopy(cfg.model)
    model.load_state_dict(checkpoint["model"])
    model.eval()
    return model
