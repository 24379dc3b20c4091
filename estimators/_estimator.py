"""``RingEstimator``: data-parallel training of a model as a Spark ML ``Estimator``.

``fit(df)`` is the data path of docs/architecture.md, five steps of ``estimators/fit/``,
each handing the next what it made and none calling back into an earlier one:

1. **Resolve** (``fit/_resolve.py``): every param checked against ``df.schema``, the
   model's framework found through the registry (``estimators.frameworks``) and its own
   params resolved, the defaults filled in, the run chosen, the store probed and, for
   the Spark launcher, the cluster's task slots counted; no Spark job runs. On Spark
   Connect the server must see the store.
2. **Check** (``fit/_check.py``): one job checks the data; two rows go through the model.
3. **Write** (``fit/_write.py``): the data as balanced Parquet in the Store (or reused).
4. **Launch** (``fit/_launch.py``): the framework's worker function runs on ``num_proc``
   Spark tasks through the ``launcher`` seam, while the metrics of each epoch are shown.
5. **Build** (``fit/_build.py``): the :class:`RingModel` from the run's final checkpoint.

``fit_on_parquet`` skips steps 2 and 3: its data is in the store already.
"""

from __future__ import annotations

import copy
import posixpath
from collections.abc import Callable, Sequence
from typing import Any

from pyspark import keyword_only
from pyspark.ml import Estimator
from pyspark.ml.util import MLReadable, MLWritable
from pyspark.sql import DataFrame, SparkSession

from spark_runner import is_connect

from ._accessors import EstimatorAccessors
from ._model import RingModel
from ._params import (
    ESTIMATOR_PARAMS,
    HOROVOD_ONLY_PARAMS,
    checked_params,
    init_params,
    with_horovod_params,
    with_params,
)
from ._persistence import RingEstimatorReader, RingEstimatorWriter
from .fit._build import build_model
from .fit._check import check_data
from .fit._launch import launch, spark_launcher
from .fit._resolve import resolve_config
from .fit._write import describe_stored, write_data
from .store._layout import TRAIN_DATA, VAL_DATA
from .store._store import Store

__all__ = ["RingEstimator"]


def _activate(spark: SparkSession) -> None:
    """Make ``spark`` this thread's active session when the thread has none:
    ``CrossValidator`` fits in pool threads, where ``spark_runner.run`` would find none.
    A Spark Connect session (no JVM on this side) is made active through its class's
    own hook where this pyspark has it (4.x, 3.5); without it ``spark_runner.run``
    falls back to the process's default Connect session."""
    if SparkSession.getActiveSession() is not None:
        return
    if is_connect(spark):
        set_active = getattr(type(spark), "_set_default_and_active_session", None)
        if set_active is not None:
            set_active(spark)
        return
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


def _parquet_call(
    train_path: str | dict | None, val_path: str | int | None, params: dict | None, idx: Any
) -> tuple[str | None, str | None, dict | None, int | None]:
    """``fit_on_parquet``'s arguments in one shape: ``(train_path, val_path, params,
    dataset_idx)``, Horovod's positional ``fit_on_parquet(params, idx)`` included."""
    if isinstance(train_path, dict):  # Horovod's positional fit_on_parquet(params, idx)
        if params is not None:
            raise TypeError("fit_on_parquet got params twice (positionally and by name)")
        params, train_path = train_path, None
        if val_path is not None:
            if idx is not None:
                raise TypeError("fit_on_parquet got dataset_idx twice")
            idx, val_path = val_path, None
    if train_path is not None and idx is not None:
        raise ValueError(
            f"fit_on_parquet got train_path={train_path!r} and dataset_idx={idx!r}; "
            "pass one: a path, or the index of data prepared in the store"
        )
    if val_path is not None and not isinstance(val_path, str):
        raise TypeError(f"val_path must be a path in the store, got {val_path!r}")
    return train_path, val_path, params, idx


@with_horovod_params(HOROVOD_ONLY_PARAMS)
@with_params(ESTIMATOR_PARAMS)
class RingEstimator(EstimatorAccessors, Estimator, MLWritable, MLReadable["RingEstimator"]):
    """Train a torch ``nn.Module``, a LightningModule or a Keras model on a Spark
    DataFrame with ``num_proc`` workers.

    Params (each with a generated ``getX`` / ``setX``) are listed in
    ``estimators._params.ESTIMATOR_PARAMS``; pass them as keyword arguments. The
    constructor's keyword-only signature spells that table out for ``help()``, IDEs and
    type checkers; ``@keyword_only`` (Spark ML's own idiom) hands ``init_params`` only the
    keywords given, so an unpassed param keeps its table default and stays unset
    (``isSet``). Its two list defaults are never used as values.
    """

    #: The seam that starts the workers: ``launcher(fn, args, num_proc) -> results by rank``.
    launcher: Callable[[Callable[..., Any], tuple, int], list[Any]] = staticmethod(spark_launcher)

    @keyword_only
    def __init__(
        self,
        *,
        num_proc: int | None = None,
        model: Any = None,
        optimizer: Any = None,
        loss: Any = None,
        metrics: Any = [],  # noqa: B006 (a list: the table default)
        feature_cols: str | Sequence[str] | None = None,
        label_cols: str | Sequence[str] | None = None,
        validation: float | str = 0.0,
        sample_weight_col: str | None = None,
        transformation_fn: Callable[..., Any] | None = None,
        batch_size: int = 32,
        val_batch_size: int | None = None,
        epochs: int = 1,
        shuffle: bool = True,
        verbose: int = 1,
        progress: bool = True,
        random_seed: int | None = None,
        store: Store | str | None = None,
        run_id: str | None = None,
        train_steps_per_epoch: int | None = None,
        validation_steps_per_epoch: int | None = None,
        reader: str = "auto",
        train_reader_num_workers: int = 1,
        val_reader_num_workers: int = 1,
        reader_pool_type: str = "thread",
        partitions_per_process: int = 1,
        inmemory_cache_all: bool = False,
        backward_passes_per_step: int = 1,
        callbacks: Any = [],  # noqa: B006 (a list: the table default)
        trainer_args: dict[str, Any] = {},  # noqa: B006 (a dict: the table default)
        logger: Any = None,
        log_every_n_steps: int = 50,
        terminate_on_nan: bool = False,
        profiler: Any = None,
        use_gpu: bool | None = None,
        loss_weights: float | Sequence[float] | None = None,
        loss_constructors: Any = None,
        train_minibatch_fn: Callable[..., Any] | None = None,
        strategy: str = "ring",
        fsdp_config: Any = None,
        gradient_compression: Any = "none",
        lr_scheduler: Any = None,
        lr_scheduler_interval: str = "epoch",
        precision: str | int = "32",
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str = "norm",
        monitor: str = "val_loss",
        monitor_mode: str = "min",
        early_stopping_patience: int | None = None,
        early_stopping_min_delta: float = 0.0,
        restore_best_weights: bool = True,
        backend_env: dict[str, str] = {},  # noqa: B006 (a dict: the table default)
        custom_objects: dict[str, Any] = {},  # noqa: B006 (a dict: the table default)
        tensorflow_dataset_prefetch_buffer_size: int = 1,
        tokenizer: Any = None,
        max_length: int | None = None,
        checkpoint_callback: Any = None,
        **horovod_params: Any,
    ) -> None:
        """Every param of ``ESTIMATOR_PARAMS`` as a keyword (its doc: ``explainParams()``),
        defaults as in that table (tests/estimators/test_estimator_signature.py keeps them equal).
        ``horovod_params``: Horovod's estimator params; at their Horovod defaults they
        change nothing, ``num_gpus`` maps onto ``use_gpu``, any other value raises with the
        ringtrain way (``HOROVOD_ONLY_PARAMS``); an unknown name raises TypeError."""
        super().__init__()
        init_params(self, ESTIMATOR_PARAMS, self.__dict__.pop("_input_kwargs"))

    def write(self) -> RingEstimatorWriter:
        """Spark ML persistence of this (unfitted) estimator: ``est.save(path)``, or a
        ``Pipeline`` holding it; params that are not plain data (model, optimizer, loss,
        callbacks, ...) are cloudpickled. ``RingEstimator.load(path)`` runs pickled
        code: load only what you trust."""
        return RingEstimatorWriter(self)

    @classmethod
    def read(cls) -> RingEstimatorReader:
        return RingEstimatorReader(cls)

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
        spark_stage = self.launcher is spark_launcher  # its task slots are counted first
        cfg = resolve_config(self, dataset, slots=spark_stage)  # 1. no job yet
        checked = check_data(dataset, cfg)  # 2. one job, a first batch through the model
        data = write_data(dataset, cfg, checked)  # 3. the Parquet in the store
        history = launch(self.launcher, cfg, data)  # 4. the workers train
        return build_model(cfg, data, history, self.getUseGpu())  # 5. the final checkpoint

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
        train, val, params, dataset_idx = _parquet_call(train_path, val_path, params, dataset_idx)
        est = self.copy(params) if params else self
        if train is None:
            store = est.getStore() if est.isSet("store") else None
            if store is None:
                raise ValueError(
                    "fit_on_parquet without train_path reads the data prepared in the store, "
                    "but no store is set; pass store=Store.create(prefix) (the prefix the data "
                    "was written under), or train_path=..."
                )
            train, val = _horovod_paths(store, dataset_idx)
        cfg = resolve_config(est, None, SparkSession.getActiveSession())
        data = describe_stored(cfg, train, val)
        return build_model(cfg, data, launch(est.launcher, cfg, data), est.getUseGpu())
