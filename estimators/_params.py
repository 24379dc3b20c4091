"""Spark ML params generated from one table each: no hand-written getters or setters.

Each row is a :class:`ParamSpec` (name, type converter, default, doc).
:func:`with_params` turns a table into class-level ``Param`` objects and a generated
``getX`` / ``setX`` pair per row (``batch_size`` → ``getBatchSize`` / ``setBatchSize``);
:func:`init_params` sets the defaults and the keyword arguments of a constructor.
Converters turn values into their canonical type; range checks that need the
DataFrame (or give a better message with it) happen in ``fit``.

The table is also the source of the types: each converter names the type it accepts
and the type it holds (:attr:`ParamSpec.accepts`, :attr:`ParamSpec.holds`). The
constructors' explicit keyword-only signatures are checked against the table
(tests/estimators/test_estimator_signature.py), and ``_accessor_types.render_accessors`` writes
the typed declarations of every generated accessor that type checkers read
(``_accessors.py``, committed; the same test checks it is current).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.ml.param import Param, Params, TypeConverters

from .data._columns import LABEL_KINDS
from .frameworks.lightning._trainer_args import to_trainer_args
from .store._store import Store

__all__ = [
    "ESTIMATOR_PARAMS",
    "HOROVOD_ONLY_PARAMS",
    "MODEL_PARAMS",
    "HorovodParam",
    "ParamSpec",
    "accessor_names",
    "checked_params",
    "horovod_param",
    "init_params",
    "with_horovod_params",
    "with_params",
]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    converter: Callable[[Any], Any]
    default: Any
    doc: str

    @property
    def accepts(self) -> str:
        """The type a constructor keyword or a setter takes, as an annotation string."""
        return _optional(_CONVERTER_TYPES[self.converter][0], self.default)

    @property
    def holds(self) -> str:
        """The type the getter returns, as an annotation string."""
        return _optional(_CONVERTER_TYPES[self.converter][1], self.default)


def _optional(annotation: str, default: Any) -> str:
    return f"{annotation} | None" if default is None and annotation != "Any" else annotation


# --- converters (None means "unset" and never reaches them) --------------------------


def _to_columns(value: Any) -> list[str]:
    """A column name or a list of them → a list of names."""
    if isinstance(value, str):
        return [value]
    return TypeConverters.toListString(value)


def _to_metrics(value: Any) -> list[Any]:
    items = [value] if isinstance(value, str) or callable(value) else TypeConverters.toList(value)
    for item in items:
        if not (isinstance(item, str) or callable(item)):
            raise TypeError(
                f"a metric is a name such as 'accuracy' or a callable fn(output, label); got {item!r}"
            )
    return list(items)


def _to_store(value: Any) -> Store:
    if isinstance(value, Store):
        return value
    if isinstance(value, str):
        return Store.create(value)
    raise TypeError(f"store takes a Store or a path, got {type(value).__name__}")


def _to_validation(value: Any) -> float | str:
    """A fraction of the rows, or the name of a bool/int column marking validation rows."""
    if isinstance(value, str):
        return value
    return TypeConverters.toFloat(value)


def _to_callable(value: Any) -> Any:
    if not callable(value):
        raise TypeError(f"expected a callable, got {type(value).__name__}")
    return value


def _to_callbacks(value: Any) -> list[Any]:
    items = [value] if not isinstance(value, (list, tuple)) else list(value)
    return items


def _to_floats(value: Any) -> list[float]:
    """A number or a list of numbers (one per label column) → a list of floats."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return [float(value)]
    return TypeConverters.toListFloat(value)


def _to_callables(value: Any) -> list[Any]:
    items = [value] if callable(value) else TypeConverters.toList(value)
    for item in items:
        if not callable(item):
            raise TypeError(f"expected callables (one per label column), got {item!r}")
    return list(items)


def _to_float(value: Any) -> float:
    return TypeConverters.toFloat(value)


def _to_strategy(value: Any) -> str:
    """A registered strategy's name (``ringcore.torch.strategies``); unknown: ValueError."""
    from ringcore.torch.strategies import get_strategy

    get_strategy(value)  # raises naming the known ones
    return str(value)


GRADIENT_COMPRESSIONS = ("none", "fp16")


def _to_compression(value: Any) -> str:
    """Horovod's ``Compression.none`` / ``Compression.fp16`` (or their names) → the name."""
    name = value if isinstance(value, str) else getattr(value, "__name__", None)
    if isinstance(value, type) and name is not None:
        name = {"NoneCompressor": "none", "FP16Compressor": "fp16"}.get(name, name)
    if name not in GRADIENT_COMPRESSIONS:
        from ringcore.torch import Compression

        for known in GRADIENT_COMPRESSIONS:
            if value is getattr(Compression, known):
                return known
        raise ValueError(
            f"gradient_compression takes Compression.none or Compression.fp16 (ringcore.torch) "
            f"or their names 'none' / 'fp16', got {value!r}."
        )
    return name


PRECISIONS = {
    "32": "32",
    "32-true": "32",
    "bf16": "bf16",
    "bf16-mixed": "bf16",
    "16": "16",
    "16-mixed": "16",
}


def _to_precision(value: Any) -> str:
    """``"32"`` | ``"bf16"`` | ``"16"`` (Lightning's spellings ``"bf16-mixed"``, ``16`` too)."""
    key = str(value)
    if key not in PRECISIONS:
        raise ValueError(
            f"precision takes '32', 'bf16' or '16' (also Lightning's 'bf16-mixed', '16-mixed'), "
            f"got {value!r}."
        )
    return PRECISIONS[key]


def _to_env(value: Any) -> dict[str, str]:
    """Environment variables for the workers: a dict of names to string values."""
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise TypeError(
            f"backend_env takes a dict of str to str (variable -> value), got {value!r}"
        )
    return dict(value)


def _to_dict(value: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"expected a dict of name -> object, got {type(value).__name__}")
    return dict(value)


def _to_history(value: Any) -> list[dict[str, Any]]:
    return [dict(entry) for entry in value]


def _to_label_kinds(value: Any) -> list[str]:
    """Per label column, what it was at fit time: "scalar", "array" or "vector"."""
    kinds = _to_columns(value)
    wrong = [k for k in kinds if k not in LABEL_KINDS]
    if wrong:
        raise ValueError(
            f"label_kinds takes {', '.join(map(repr, LABEL_KINDS))} per label column, "
            f"got {wrong[0]!r}."
        )
    return kinds


_int = TypeConverters.toInt
_str = TypeConverters.toString
_bool = TypeConverters.toBoolean
_any = TypeConverters.identity

# converter -> (what it accepts, what it holds), as annotations (None is added where unset)
_CONVERTER_TYPES: dict[Callable[[Any], Any], tuple[str, str]] = {
    _int: ("int", "int"),
    _str: ("str", "str"),
    _bool: ("bool", "bool"),
    _any: ("Any", "Any"),
    _to_columns: ("str | Sequence[str]", "list[str]"),
    _to_metrics: ("Any", "list[Any]"),
    _to_store: ("Store | str", "Store"),
    _to_validation: ("float | str", "float | str"),
    _to_callable: ("Callable[..., Any]", "Callable[..., Any]"),
    _to_callbacks: ("Any", "list[Any]"),
    _to_history: ("Sequence[dict[str, Any]]", "list[dict[str, Any]]"),
    to_trainer_args: ("dict[str, Any]", "dict[str, Any]"),
    _to_label_kinds: ("str | Sequence[str]", "list[str]"),
    _to_floats: ("float | Sequence[float]", "list[float]"),
    _to_callables: ("Any", "list[Any]"),
    _to_float: ("float", "float"),
    _to_compression: ("Any", "str"),
    _to_strategy: ("str", "str"),
    _to_precision: ("str | int", "str"),
    _to_env: ("dict[str, str]", "dict[str, str]"),
    _to_dict: ("dict[str, Any]", "dict[str, Any]"),
}


# One row per param, kept one line each so that the table reads as a table.
# fmt: off
ESTIMATOR_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("num_proc", _int, None, "number of worker processes (Spark tasks); default: the cluster's default parallelism"),
    ParamSpec("model", _any, None, "the torch.nn.Module to train"),
    ParamSpec("optimizer", _any, None, "a torch.optim.Optimizer built on model.parameters(); every worker rebuilds it on its replica"),
    ParamSpec("loss", _any, None, "loss function loss(output, label) -> scalar tensor, e.g. torch.nn.CrossEntropyLoss()"),
    ParamSpec("metrics", _to_metrics, [], "metrics computed each epoch: names ('accuracy') or callables fn(output, label) -> scalar"),
    ParamSpec("feature_cols", _to_columns, None, "input columns, passed to model(*features) in this order"),
    ParamSpec("label_cols", _to_columns, None, "label columns, one per model output"),
    ParamSpec("validation", _to_validation, 0.0, "fraction of the rows held out for validation, in [0, 1), or the name of a bool/int column that is true (non-zero) on validation rows"),
    ParamSpec("sample_weight_col", _str, None, "column of per-row weights of the loss (numeric); default: every row weighs 1"),
    ParamSpec("transformation_fn", _to_callable, None, "fn(batch) -> batch applied by the workers to every batch, a dict {column: numpy array}"),
    ParamSpec("batch_size", _int, 32, "rows per training step on each process"),
    ParamSpec("val_batch_size", _int, None, "rows per validation step; default: batch_size"),
    ParamSpec("epochs", _int, 1, "passes over the training data"),
    ParamSpec("shuffle", _bool, True, "shuffle the training rows each epoch"),
    ParamSpec("verbose", _int, 1, "0: silent; 1: one line of metrics per epoch"),
    ParamSpec("progress", _bool, True, "a live progress bar on the driver (step, loss, rows/s of rank 0): a tqdm bar on a terminal, the notebook widget in Jupyter, else a plain line every few seconds; RING_PROGRESS=0 turns it off everywhere"),
    ParamSpec("random_seed", _int, None, "seed of the validation split and the shuffles; default: random"),
    ParamSpec("store", _to_store, None, "Store (or a path) for the intermediate data and the runs; default: a new temporary directory"),
    ParamSpec("run_id", _str, None, "name of this run under <store>/runs/; an existing run resumes from its checkpoint; default: generated"),
    ParamSpec("train_steps_per_epoch", _int, None, "training steps per epoch on every process; default: train rows // (batch_size * num_proc)"),
    ParamSpec("validation_steps_per_epoch", _int, None, "validation steps per epoch on every process; default: the whole validation shard"),
    ParamSpec("reader", _str, "auto", "Parquet reader of the workers: 'petastorm', 'arrow', or 'auto' (petastorm where the stack check finds it working, else arrow)"),
    ParamSpec("train_reader_num_workers", _int, 1, "training reader workers per process: petastorm's pool of threads (or processes), or the row groups the arrow reader reads ahead in threads"),
    ParamSpec("val_reader_num_workers", _int, 1, "validation reader workers per process, as train_reader_num_workers"),
    ParamSpec("reader_pool_type", _str, "thread", "the readers' pool: 'thread' (petastorm decodes in a pool of *_reader_num_workers threads; the arrow reader reads that many row groups ahead), 'process' (petastorm's process pool; needs pyzmq) or 'dummy' (each row group read inline)"),
    ParamSpec("partitions_per_process", _int, 1, "Parquet files written per process (num_proc x this, equal rows each): smaller files for object stores and petastorm's row-group shards (Horovod's default is 10)"),
    ParamSpec("inmemory_cache_all", _bool, False, "each worker reads its training shard into memory once and serves every epoch from there (shuffled per epoch)"),
    ParamSpec("backward_passes_per_step", _int, 1, "gradient accumulation: backward passes per optimizer step"),
    ParamSpec("callbacks", _to_callbacks, [], "torch: objects with any of on_train_begin(logs), on_epoch_begin(epoch, logs), on_batch_end(batch, logs), on_epoch_end(epoch, logs), on_train_end(logs), called on every rank; lightning: lightning.pytorch.Callback objects, given to every rank's Trainer"),
    ParamSpec("trainer_args", to_trainer_args, {}, "lightning: more lightning.Trainer keyword arguments, e.g. {'precision': 'bf16-mixed', 'gradient_clip_val': 1.0}; devices, num_nodes, max_epochs and enable_checkpointing are ringtrain's; strategy: none (ringtrain's RingStrategy) or 'ddp' (Lightning's DDPStrategy on the job's process group)"),
    ParamSpec("logger", _any, None, "lightning: the Trainer's logger (a lightning logger, on every rank); default None: none (the history is in the store and RingModel.getHistory())"),
    ParamSpec("log_every_n_steps", _int, 50, "lightning: the Trainer's log_every_n_steps"),
    ParamSpec("terminate_on_nan", _bool, False, "lightning: a non-finite training loss fails the fit"),
    ParamSpec("profiler", _any, None, "lightning: the Trainer's profiler ('simple', 'advanced' or a lightning Profiler)"),
    ParamSpec("use_gpu", _bool, None, "train and predict on the task's GPU (NCCL between GPUs); default: when CUDA is present"),
    ParamSpec("loss_weights", _to_floats, None, "torch: per label column, the weight of its loss in the sum (Horovod's loss_weights); default: 1 each"),
    ParamSpec("loss_constructors", _to_callables, None, "torch: per label column (or one for all), a function of no arguments returning its loss, called on every worker (Horovod's); instead of loss"),
    ParamSpec("train_minibatch_fn", _to_callable, None, "torch: Horovod's train_minibatch(model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights, backward_passes_per_step, batch_idx) -> (outputs, loss), doing the forward, backward and optimizer steps of one batch"),
    ParamSpec("strategy", _to_strategy, "ring", "torch: how the model is trained across the processes: 'ring' (Horovod's: whole replicas, gradients averaged by the ring), 'ddp' (torch DistributedDataParallel) or 'fsdp' (FSDP2: parameters, gradients and optimizer state sharded; sharded checkpoints)"),
    ParamSpec("fsdp_config", _any, None, "torch, strategy='fsdp': a dict (or ringcore.torch.strategies.FsdpConfig) of param_dtype, reduce_dtype, reshard_after_forward, cpu_offload, shard_modules; default: FSDP2's defaults, each ModuleList's modules a unit"),
    ParamSpec("gradient_compression", _to_compression, "none", "torch: gradients on the wire: 'none' or 'fp16' (or ringcore.torch.Compression.none / .fp16)"),
    ParamSpec("lr_scheduler", _any, None, "torch: a torch.optim.lr_scheduler built on the optimizer, or fn(optimizer) -> scheduler; rebuilt on every worker's optimizer"),
    ParamSpec("lr_scheduler_interval", _str, "epoch", "torch: lr_scheduler.step() after every 'epoch' or every optimizer 'step'; ReduceLROnPlateau gets the monitor metric each epoch"),
    ParamSpec("precision", _to_precision, "32", "torch: '32'; 'bf16': forward and loss under torch.autocast(bfloat16) (CPU or GPU); '16': float16 autocast with a GradScaler (GPU only)"),
    ParamSpec("gradient_clip_val", _to_float, None, "torch: clip the averaged gradients before each optimizer step to this norm (or value); default: no clipping"),
    ParamSpec("gradient_clip_algorithm", _str, "norm", "torch: 'norm' (clip_grad_norm_) or 'value' (clip_grad_value_)"),
    ParamSpec("monitor", _str, "val_loss", "torch: the history metric early stopping and restore_best_weights watch, e.g. 'val_loss', 'val_accuracy'"),
    ParamSpec("monitor_mode", _str, "min", "torch: 'min' or 'max': whether a lower or a higher monitor is better"),
    ParamSpec("early_stopping_patience", _int, None, "torch: stop (every rank at once) after this many epochs without the monitor improving by early_stopping_min_delta; default: no early stopping"),
    ParamSpec("early_stopping_min_delta", _to_float, 0.0, "torch: the least change of the monitor that counts as an improvement"),
    ParamSpec("restore_best_weights", _bool, True, "torch: the returned model has the weights of the epoch with the best monitor (when the history has it); False: the last epoch's"),
    ParamSpec("backend_env", _to_env, {}, "environment variables set in every worker process for the fit (Horovod's backend_env)"),
    ParamSpec("custom_objects", _to_dict, {}, "keras: custom layers, losses and metrics by name, for loading the model on the workers and the driver (Horovod's)"),
    ParamSpec("tensorflow_dataset_prefetch_buffer_size", _int, 1, "keras: batches the workers' tf.data pipeline prefetches; 0: none"),
    ParamSpec("tokenizer", _any, None, "huggingface: a transformers tokenizer, sent to the workers: the string feature column is tokenized there (and in transform) into the model's inputs by name (input_ids, attention_mask, ...)"),
    ParamSpec("max_length", _int, None, "huggingface: with tokenizer, pad and truncate every text to this many tokens; default: the tokenizer's model_max_length"),
    ParamSpec("checkpoint_callback", _any, None, "keras: a keras.callbacks.ModelCheckpoint (Horovod's); rank 0 runs it with its filepath set to <store>/runs/<run_id>/best.keras (or best.weights.h5) and fit returns the model it saved last (save_best_only=True: the best epoch by its monitor); default: the last epoch's"),
)

MODEL_PARAMS: tuple[ParamSpec, ...] = (
    ParamSpec("model", _any, None, "the trained torch.nn.Module"),
    ParamSpec("history", _to_history, [], "per-epoch metrics of the training run, one dict per epoch"),
    ParamSpec("run_id", _str, None, "the run that trained this model"),
    ParamSpec("feature_cols", _to_columns, None, "input columns, passed to model(*features) in this order"),
    ParamSpec("label_cols", _to_columns, None, "label columns the model was trained on"),
    ParamSpec("label_kinds", _to_label_kinds, None, "per label column, 'scalar', 'array' or 'vector' (a Spark ML Vector) as at fit time; a 'vector' label gives a dense Vector output column; default: typed from the output's shape"),
    ParamSpec("output_cols", _to_columns, None, "columns transform() appends; default: <label>__output"),
    ParamSpec("feature_shapes", _any, None, "per feature column, the shape of one row's value, e.g. [[64]]"),
    ParamSpec("store", _to_store, None, "the Store the model was trained in"),
    ParamSpec("use_gpu", _bool, None, "torch: transform() predicts on the task's GPU; None (default): when the task sees CUDA; True: a task without CUDA fails"),
    ParamSpec("tokenizer", _any, None, "huggingface: the tokenizer transform() runs on the text feature column (the fit's)"),
    ParamSpec("max_length", _int, None, "huggingface: with tokenizer, the tokens per text (the fit's); default: the tokenizer's model_max_length"),
    ParamSpec("model_output", _str, None, "huggingface: the field of the model's output transform() writes to the output column, e.g. 'pooler_output' or 'last_hidden_state'; default: 'logits'"),
)
# fmt: on


def _camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_"))


def accessor_names(spec: ParamSpec) -> tuple[str, str]:
    """``("getBatchSize", "setBatchSize")`` for ``batch_size``."""
    return f"get{_camel(spec.name)}", f"set{_camel(spec.name)}"


def _accessors(spec: ParamSpec) -> tuple[Callable[..., Any], Callable[..., Any]]:
    def getter(self: Params) -> Any:
        return self.getOrDefault(spec.name)

    def setter(self: Params, value: Any) -> Params:
        return self._set(**{spec.name: value})

    get_name, set_name = accessor_names(spec)
    getter.__name__, setter.__name__ = get_name, set_name
    getter.__doc__ = f"Gets the value of {spec.name}: {spec.doc}."
    setter.__doc__ = f"Sets {spec.name}: {spec.doc}."
    return getter, setter


def with_params(specs: Sequence[ParamSpec]) -> Callable[[type], type]:
    """Class decorator: declare the table's params and their getters/setters on the class."""

    def declare(cls: type) -> type:
        for spec in specs:
            setattr(
                cls,
                spec.name,
                Param(Params._dummy(), spec.name, spec.doc, typeConverter=spec.converter),
            )
            getter, setter = _accessors(spec)
            setattr(cls, getter.__name__, getter)
            setattr(cls, setter.__name__, setter)
        cls._param_specs = tuple(specs)  # type: ignore[attr-defined]
        return cls

    return declare


def checked_params(
    instance: Params, specs: Sequence[ParamSpec], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``kwargs`` as values of the table's params: Horovod-only params mapped or refused
    (:data:`HOROVOD_ONLY_PARAMS`), other unknown names raise TypeError."""
    known = {spec.name for spec in specs}
    owner = type(instance).__name__
    ours = {k: v for k, v in kwargs.items() if k not in _HOROVOD_BY_NAME or k in known}
    for name in sorted(set(kwargs) - set(ours)):
        for key, value in horovod_param(owner, name, kwargs[name]).items():
            if key in ours and ours[key] != value:
                raise ValueError(
                    f"{name}={kwargs[name]!r} means {key}={value!r}, but {key}={ours[key]!r} "
                    f"was passed too; pass only {key}"
                )
            ours[key] = value
    unknown = sorted(set(ours) - known)
    if unknown:
        raise TypeError(
            f"{owner} got unknown param(s) {', '.join(unknown)}; "
            f"its params are: {', '.join(sorted(known))}"
        )
    return ours


def init_params(instance: Params, specs: Sequence[ParamSpec], kwargs: dict[str, Any]) -> None:
    """Set the table's defaults, then ``kwargs`` (checked by :func:`checked_params`)."""
    values = checked_params(instance, specs, kwargs)
    instance._setDefault(**{spec.name: spec.default for spec in specs})
    instance._set(**values)


# --- Horovod's estimator params that RingEstimator does not have -------------------


@dataclass(frozen=True)
class HorovodParam:
    """A param of Horovod's ``TorchEstimator`` / ``KerasEstimator`` / Lightning estimator
    that is not in :data:`ESTIMATOR_PARAMS`. Passing it with a value in ``inert`` (its
    Horovod default, or None) changes nothing and is accepted; ``alias`` maps a value onto
    our params; any other value raises with ``why``: the ringtrain way, or why it does not
    apply."""

    name: str
    why: str
    inert: tuple[Any, ...] = (None,)
    alias: Callable[[Any], dict[str, Any]] | None = None


def _num_gpus(value: Any) -> dict[str, Any]:
    """Lightning's ``num_gpus``: 0 trains on CPU, 1 on each task's GPU."""
    if value in (0, 1) and not isinstance(value, bool):
        return {"use_gpu": bool(value)}
    raise ValueError(
        f"num_gpus={value!r}: each RingEstimator process trains on one GPU (the one Spark "
        "gives its task); pass use_gpu=True (num_gpus=1) or use_gpu=False (num_gpus=0), and "
        "more GPUs with num_proc."
    )


# fmt: off
HOROVOD_ONLY_PARAMS: tuple[HorovodParam, ...] = (
    HorovodParam("backend", "RingEstimator always launches its workers as one Spark barrier stage of the active SparkSession (spark_runner.run); size it with num_proc instead of a SparkBackend"),
    HorovodParam("compress_sparse_cols", "SparseVector columns are written dense (as arrays); there is no compressed sparse format to choose", inert=(None, False)),
    HorovodParam("continuous_cols", "list every input column in feature_cols (the model gets them in that order)"),
    HorovodParam("categorical_cols", "list every input column in feature_cols (the model gets them in that order)"),
    HorovodParam("shuffle_buffer_size", "deprecated in Horovod too; ringtrain shuffles each process's whole shard every epoch (shuffle=True)"),
    HorovodParam("transformation_edit_fields", "transformation_fn's output is used as it comes (no petastorm TransformSpec schema to declare); drop it"),
    HorovodParam("transformation_removed_fields", "transformation_fn's output is used as it comes (no petastorm TransformSpec schema to declare); drop it"),
    HorovodParam("label_shapes", "labels keep the shape they have in the DataFrame; reshape them in the loss or in transformation_fn"),
    HorovodParam("input_shapes", "the features' shapes are read from the data, so there is nothing to declare; drop it"),
    HorovodParam("mp_start_method", "the workers are Spark tasks, not multiprocessing children; there is no start method to choose"),
    HorovodParam("data_module", "choose the reader with reader='petastorm' | 'arrow' | 'auto'; custom data modules are not offered"),
    HorovodParam("num_gpus", "use use_gpu=True or False", alias=_num_gpus),
    HorovodParam("loader_num_epochs", "each epoch reads the shard once; there is no loader epoch count to set"),
    HorovodParam("debug_data_loader", "not offered; inspect batches with transformation_fn", inert=(None, False)),
    HorovodParam("train_async_data_loader_queue_size", "batches are read in the training process; there is no async loader queue to size"),
    HorovodParam("val_async_data_loader_queue_size", "batches are read in the training process; there is no async loader queue to size"),
)
# fmt: on

_HOROVOD_BY_NAME = {p.name: p for p in HOROVOD_ONLY_PARAMS}


def _inert(spec: HorovodParam, value: Any) -> bool:
    try:
        return any(value is v or value == v for v in spec.inert)
    except Exception:  # a value whose == does not give a bool (an array)
        return False


def horovod_param(owner: str, name: str, value: Any) -> dict[str, Any]:
    """Our params for Horovod's param ``name`` set to ``value`` ({} when it changes
    nothing); raises with the ringtrain way when it has no counterpart."""
    spec = _HOROVOD_BY_NAME[name]
    if _inert(spec, value):
        return {}
    if spec.alias is not None:
        return spec.alias(value)
    raise ValueError(
        f"{owner} has no param {name} (Horovod's estimators do; got {name}={value!r}): {spec.why}."
    )


def with_horovod_params(specs: Sequence[HorovodParam]) -> Callable[[type], type]:
    """Class decorator: a ``setX`` per Horovod-only param, with the same checks as the
    constructor (Horovod scripts call ``setBackend(...)``, ``setLossWeights(...)``)."""

    def declare(cls: type) -> type:
        for spec in specs:

            def setter(self: Params, value: Any, _name: str = spec.name) -> Params:
                return self._set(**horovod_param(type(self).__name__, _name, value))

            setter.__name__ = f"set{_camel(spec.name)}"
            setter.__doc__ = f"Horovod's {spec.name}: {spec.why}."
            setattr(cls, setter.__name__, setter)
        return cls

    return declare
