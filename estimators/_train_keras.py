"""Keras models in the estimator: the worker's training loop and the driver's helpers.

Worker (``train_keras(spec)``), in small named steps:

1. ``ringcore.keras.init()``; rebuild the model from its ``.keras`` bytes, compile it
   with the optimizer (from its config) wrapped in ``DistributedOptimizer``, the loss
   and the metrics, and build the optimizer's state on every rank (a built model).
2. Resume from the run's checkpoint when there is one (rank 0 reads it; the
   broadcast callback gives every rank rank 0's weights and optimizer state at
   ``on_train_begin``: every rank broadcasts the same variables, its optimizer built).
3. ``model.fit`` on a ``tf.data`` pipeline over this rank's shard from
   ``ringcore.data.make_reader`` (sharded by rank, the same ``steps_per_epoch`` on
   every rank), validating on the rank's validation shard (streamed from the store
   once per epoch, never held whole); ``MetricAverageCallback``
   averages the metrics over the ranks (each rank's validation mean weighs the same:
   the shards differ by one row at most); the user's ``callbacks`` (Keras callbacks)
   run after these, on every rank.
4. Rank 0 writes the model (``.keras``, with the history so far as a member of its
   zip) as the run's checkpoint and the history (the torch loop's format:
   ``train_<metric>``, ``val_<metric>``, ``epoch``, ``seconds``) to the Store after
   every epoch; a resume takes its epochs from the checkpoint it loads.

Driver: :func:`keras_worker` (the spec), :func:`load_keras_checkpoint`,
:func:`keras_predictor` (``RingModel.transform`` in Arrow batches),
:func:`save_keras_model` / :func:`load_keras_model` (``RingModel.save/load``).
A model with custom layers, losses or metrics loads with the ``custom_objects`` param
(Horovod's: name -> class or function) on the workers, on the driver, in
``RingModel.transform``'s tasks and in ``RingModel.load`` (saved with the model,
cloudpickled); classes registered with ``keras.saving.register_keras_serializable``
need nothing. ``checkpoint_callback`` (Horovod's: a ``keras.callbacks.ModelCheckpoint``)
runs on rank 0 with its ``filepath`` set to a file of the run
(``<store>/runs/<run_id>/best.keras``); the model ``fit`` returns is the last one it
saved (with ``save_best_only=True``: the best epoch by its ``monitor``). The run's own
per-epoch checkpoint (for resuming) is kept as before.
TensorFlow is imported only inside these functions: a torch fit never pays for it.
"""

from __future__ import annotations

import os
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import cloudpickle
import fsspec
import numpy as np
import pyarrow as pa
from pyspark.sql.types import ArrayType, DataType, DoubleType

from ringcore.data import to_numpy_columns

from ._checkpoints import history_in, read_checkpoint, with_history
from ._progress import keras_progress_callbacks
from ._readers import open_training, validation_shard
from ._spec import DataSpec, data_spec_fields, writer
from ._train_torch import _columns, _local_copies

__all__ = [
    "KerasTrainSpec",
    "check_keras",
    "keras_predictor",
    "keras_worker",
    "load_keras_checkpoint",
    "load_keras_model",
    "save_keras_model",
    "train_keras",
]

_MODEL_FILE = "model.keras"
_CUSTOM_OBJECTS_FILE = "custom_objects.pkl"


@dataclass(frozen=True, kw_only=True)
class KerasTrainSpec(DataSpec):
    """Everything a Keras worker needs, as picklable data."""

    model_bytes: bytes  # the model as a .keras file
    compile_objects: bytes  # cloudpickle of (optimizer config, loss, metrics)
    callbacks: bytes = b""  # cloudpickle of the user's keras.callbacks.Callback list
    custom_objects: bytes = b""  # cloudpickle of {name: class or function} (Horovod's)
    prefetch: int = 1  # batches the tf.data pipeline prefetches (0: none)
    checkpoint_callback: bytes = b""  # cloudpickle of a keras ModelCheckpoint (rank 0 runs it)


# --- .keras bytes ------------------------------------------------------------------------------


def model_to_bytes(model: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="ringtrain-keras-") as tmp:
        path = os.path.join(tmp, _MODEL_FILE)
        model.save(path)
        with open(path, "rb") as f:
            return f.read()


def model_from_bytes(
    data: bytes, compile: bool = False, custom_objects: dict[str, Any] | None = None
) -> Any:
    """The model of ``.keras`` bytes; ``custom_objects`` resolve its custom classes and
    are remembered with it (:func:`custom_objects_of`) for its later loads."""
    import keras

    with tempfile.TemporaryDirectory(prefix="ringtrain-keras-") as tmp:
        path = os.path.join(tmp, _MODEL_FILE)
        with open(path, "wb") as f:
            f.write(data)
        model = keras.models.load_model(path, compile=compile, custom_objects=custom_objects)
    if custom_objects:
        _CUSTOM_OBJECTS[model] = dict(custom_objects)
    return model


# the custom_objects a model was loaded with: transform's tasks and RingModel.save need them
_CUSTOM_OBJECTS: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()


def custom_objects_of(model: Any) -> dict[str, Any]:
    """The ``custom_objects`` this process loaded ``model`` with ({}: none)."""
    return _CUSTOM_OBJECTS.get(model, {})


# --- driver: checks and the spec ----------------------------------------------------------------


def _compiled(model: Any) -> dict[str, Any]:
    config = getattr(model, "_compile_config", None)
    return dict(config.config) if config is not None and model.compiled else {}


def check_keras(model: Any, optimizer: Any, loss: Any) -> None:
    """A Keras model needs an optimizer and a loss: as params, or from ``model.compile``."""
    import keras

    compiled = _compiled(model)
    optimizer = optimizer if optimizer is not None else compiled.get("optimizer")
    if optimizer is None:
        raise ValueError(
            "the Keras model has no optimizer: compile it (model.compile(optimizer=..., loss=...)) "
            "or pass setOptimizer(keras.optimizers.Adam(1e-3))."
        )
    if not isinstance(optimizer, keras.optimizers.Optimizer | str):
        raise ValueError(
            f"optimizer must be a keras.optimizers.Optimizer for a Keras model, got "
            f"{type(optimizer).__name__}. Set it with setOptimizer(keras.optimizers.Adam(1e-3))."
        )
    if (loss if loss is not None else compiled.get("loss")) is None:
        raise ValueError(
            "the Keras model has no loss: compile it with loss=... or pass "
            "setLoss('sparse_categorical_crossentropy'), for example."
        )


def _serializable(value: Any) -> Any:
    """Keras objects as their config; strings and plain functions as they are."""
    import keras

    if isinstance(value, list | tuple):
        return [_serializable(v) for v in value]
    if isinstance(value, keras.losses.Loss | keras.metrics.Metric):
        return {"__keras__": keras.saving.serialize_keras_object(value)}
    return value


def _deserialized(value: Any) -> Any:
    import keras

    if isinstance(value, list):
        return [_deserialized(v) for v in value]
    if isinstance(value, dict) and "__keras__" in value:
        return keras.saving.deserialize_keras_object(value["__keras__"])
    return value


def keras_worker(cfg: Any, data: Any) -> tuple[Callable[..., Any], tuple]:
    """``(train_keras, (spec,))`` for a fit of a Keras model."""
    import keras

    compiled = _compiled(cfg.model)
    optimizer = cfg.optimizer if cfg.optimizer is not None else compiled["optimizer"]
    optimizer = keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer
    loss = cfg.loss if cfg.loss is not None else compiled.get("loss")
    metrics = list(cfg.metrics) or list(compiled.get("metrics") or [])
    objects = (keras.optimizers.serialize(optimizer), _serializable(loss), _serializable(metrics))
    foreign = [cb for cb in cfg.callbacks if not isinstance(cb, keras.callbacks.Callback)]
    if foreign:
        raise ValueError(
            f"callbacks of a Keras model must be keras.callbacks.Callback objects, got "
            f"{', '.join(type(cb).__name__ for cb in foreign)}. Subclass keras.callbacks.Callback."
        )
    knobs = cfg.knobs
    _check_checkpoint_callback(knobs.checkpoint_callback)
    spec = KerasTrainSpec(
        model_bytes=model_to_bytes(cfg.model),
        compile_objects=cloudpickle.dumps(objects),
        **data_spec_fields(cfg, data),
        callbacks=cloudpickle.dumps(list(cfg.callbacks)),
        custom_objects=cloudpickle.dumps(dict(knobs.custom_objects)),
        prefetch=knobs.tensorflow_dataset_prefetch_buffer_size,
        checkpoint_callback=(
            cloudpickle.dumps(knobs.checkpoint_callback) if knobs.checkpoint_callback else b""
        ),
    )
    return train_keras, (spec,)


def _check_checkpoint_callback(callback: Any) -> None:
    import keras

    if callback is None:
        return
    if not isinstance(callback, keras.callbacks.Callback) or not hasattr(callback, "filepath"):
        raise ValueError(
            f"checkpoint_callback takes a keras.callbacks.ModelCheckpoint (Horovod's: it decides "
            f"which epoch's model fit returns), got {type(callback).__name__}. Pass "
            "keras.callbacks.ModelCheckpoint('best.keras', monitor='val_loss', "
            "save_best_only=True), or other callbacks with setCallbacks([...])."
        )


def _best_path(spec_or_cfg: Any, weights_only: bool) -> str:
    """Where the run keeps what ``checkpoint_callback`` saved."""
    name = "best.weights.h5" if weights_only else "best.keras"
    return f"{spec_or_cfg.store.get_run_path(spec_or_cfg.run_id)}/{name}"


def load_keras_checkpoint(cfg: Any) -> Any:
    """The trained Keras model (not compiled): what ``checkpoint_callback`` saved last when
    it is set and saved anything, else the run's final checkpoint."""
    objects = dict(cfg.knobs.custom_objects)
    store = cfg.store
    model = model_from_bytes(read_checkpoint(store, cfg.run_id), custom_objects=objects)
    callback = cfg.knobs.checkpoint_callback
    if callback is None:
        return model
    weights_only = bool(getattr(callback, "save_weights_only", False))
    best = _best_path(cfg, weights_only)
    if not store.exists(best):
        return model
    if not weights_only:
        return model_from_bytes(store.read_bytes(best), custom_objects=objects)
    with tempfile.TemporaryDirectory(prefix="ringtrain-keras-") as tmp:
        path = os.path.join(tmp, "best.weights.h5")
        with open(path, "wb") as f:
            f.write(store.read_bytes(best))
        model.load_weights(path)
    return model


# --- worker: batches as a tf.data pipeline ------------------------------------------------------


def _arrays(spec: KerasTrainSpec, batch: dict[str, np.ndarray]) -> tuple:
    """``(inputs, labels[, weights])`` of one batch: float32, a scalar feature as (rows, 1);
    one array for one column, a tuple for several."""
    if spec.transformation_fn is not None:
        batch = spec.transformation_fn(batch)
    feats = [np.asarray(batch[c], np.float32) for c in spec.feature_cols]
    feats = [f.reshape(-1, 1) if f.ndim == 1 else f for f in feats]
    labels = [np.asarray(batch[c], np.float32) for c in spec.label_cols]
    item: tuple = (
        feats[0] if len(feats) == 1 else tuple(feats),
        labels[0] if len(labels) == 1 else tuple(labels),
    )
    if spec.sample_weight_col is not None:
        item += (np.asarray(batch[spec.sample_weight_col], np.float32).reshape(-1),)
    return item


def _dataset(spec: KerasTrainSpec, batches: Iterator[dict[str, np.ndarray]]) -> Any:
    """A ``tf.data.Dataset`` of this rank's (endless) batches; shapes from the first one."""
    import tensorflow as tf

    first = _arrays(spec, next(batches))

    def generate() -> Iterator[tuple]:
        yield first
        for batch in batches:
            yield _arrays(spec, batch)

    dataset = tf.data.Dataset.from_generator(generate, output_signature=_signature(first))
    return dataset.prefetch(spec.prefetch) if spec.prefetch > 0 else dataset


def _signature(first: tuple) -> Any:
    import tensorflow as tf

    return tf.nest.map_structure(lambda a: tf.TensorSpec([None, *a.shape[1:]], tf.float32), first)


def _validation(spec: KerasTrainSpec, path: str | None, rank: int, size: int) -> Any:
    """This rank's validation shard as a ``tf.data.Dataset`` streamed from the store:
    every evaluation (each epoch) reads the shard once more in ``val_batch_size``
    batches (at most ``validation_steps_per_epoch`` of them), so memory holds a batch,
    never the shard. The shapes come from a first batch; None for an empty shard."""
    if path is None:
        return None
    import tensorflow as tf

    shard = validation_shard(spec, path, rank=rank, size=size, columns=_columns(spec))
    batches = shard.__iter__()  # a generator: closed as soon as its first batch is out
    first = next(batches, None)
    batches.close()  # the first pass stops here: its reader is closed
    if first is None:
        return None

    def generate() -> Iterator[tuple]:
        for batch in shard:  # a fresh pass over the shard each time Keras evaluates
            yield _arrays(spec, batch)

    signature = _signature(_arrays(spec, first))
    return tf.data.Dataset.from_generator(generate, output_signature=signature)


# --- worker: set-up, checkpoints, history -------------------------------------------------------


def _set_threads(local_size: int) -> None:
    import tensorflow as tf

    try:  # only possible before TensorFlow's runtime starts
        tf.config.threading.set_intra_op_parallelism_threads(
            max(1, (os.cpu_count() or 1) // local_size)
        )
        tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:
        pass


def _rebuild(spec: KerasTrainSpec, hvd: Any) -> Any:
    import keras

    model = model_from_bytes(spec.model_bytes, custom_objects=_objects(spec))
    optimizer_config, loss, metrics = cloudpickle.loads(spec.compile_objects)
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.deserialize(optimizer_config),
        backward_passes_per_step=spec.backward_passes_per_step,
    )
    model.compile(
        optimizer=optimizer,
        loss=_deserialized(loss),
        metrics=_deserialized(metrics),
        jit_compile=False,
    )
    if model.built:
        # Every rank builds its optimizer here, alike. BroadcastGlobalVariablesCallback
        # broadcasts the optimizer's variables at on_train_begin when it is built, else
        # after the first batch (Keras builds it in the first step): a rank 0 whose
        # optimizer _restore built alone broadcast variables the other ranks did not,
        # while they went on to the step's gradient allreduce, a deadlock. An unbuilt
        # model leaves every rank's optimizer unbuilt: Keras builds both in the first step.
        model.optimizer.build(model.trainable_variables)
    return model


def _restore(model: Any, spec: KerasTrainSpec, hvd: Any) -> tuple[int, list[dict[str, Any]]]:
    """Rank 0 loads the run's checkpoint when there is one (weights and optimizer
    state, into the optimizer :func:`_rebuild` built); every rank gets ``(epochs done,
    history)``. Nothing here changes which variables a rank broadcasts next."""
    done: tuple[int, list[dict[str, Any]]] = (0, [])
    if hvd.rank() == 0:  # this attempt writes the run's checkpoints from now on
        spec.store.claim_run(spec.run_id, writer(spec))
    path = spec.store.find_checkpoint(spec.run_id) if hvd.rank() == 0 else None
    if path is not None:
        data = spec.store.read_bytes(path)
        saved = model_from_bytes(data, compile=True, custom_objects=_objects(spec))
        model.set_weights(saved.get_weights())
        if saved.optimizer is not None and saved.optimizer.built and model.optimizer.built:
            for mine, theirs in zip(model.optimizer.variables, saved.optimizer.variables):
                mine.assign(theirs)
        history = history_in(data)  # None: a checkpoint of an older ringtrain
        if history is None:
            history = list(spec.store.read_json(spec.store.get_history_path(spec.run_id)))
        done = (len(history), history)
    return hvd.broadcast_object(done, root_rank=0, name="ringtrain.resume")


def _objects(spec: KerasTrainSpec) -> dict[str, Any]:
    return cloudpickle.loads(spec.custom_objects) if spec.custom_objects else {}


def _checkpointer(spec: KerasTrainSpec, rank: int, folder: str) -> Any:
    """Rank 0's ``checkpoint_callback`` writing into ``folder`` (None: not set or rank > 0)."""
    if not spec.checkpoint_callback or rank != 0:
        return None
    callback = cloudpickle.loads(spec.checkpoint_callback)
    weights_only = bool(getattr(callback, "save_weights_only", False))
    callback.filepath = os.path.join(folder, os.path.basename(_best_path(spec, weights_only)))
    return callback


def _keep_best(spec: KerasTrainSpec, callback: Any) -> None:
    """What ``checkpoint_callback`` saved last, into the run (rank 0, after the fit)."""
    if callback is not None and os.path.exists(callback.filepath):
        weights_only = bool(getattr(callback, "save_weights_only", False))
        with open(callback.filepath, "rb") as f:
            spec.store.write_bytes(_best_path(spec, weights_only), f.read())


def _epoch_callback(spec: KerasTrainSpec, history: list[dict[str, Any]], rank: int) -> Any:
    """After ``MetricAverageCallback``: the epoch's entry in the torch loop's format, and
    rank 0's checkpoint + history in the Store."""
    import keras

    class EpochRecorder(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.started = time.monotonic()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            entry: dict[str, Any] = {"epoch": epoch + 1}
            for key, value in sorted((logs or {}).items()):
                name = key if key.startswith("val_") else f"train_{key}"
                entry[name] = float(value)
            entry["seconds"] = round(time.monotonic() - self.started, 3)
            history.append(entry)
            if rank == 0:
                data = with_history(model_to_bytes(self.model), history)
                spec.store.write_checkpoint(spec.run_id, writer(spec), lambda f: f.write(data))
                spec.store.write_json(spec.store.get_history_path(spec.run_id), history)

    return EpochRecorder()


def train_keras(spec: KerasTrainSpec) -> list[dict[str, Any]] | None:
    """Train on this rank's shard; rank 0 returns the history (one dict per epoch)."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    import keras

    import ringcore.keras as hvd

    hvd.init()
    _set_threads(hvd.local_size())
    keras.utils.set_random_seed(spec.seed + hvd.rank())
    model = _rebuild(spec, hvd)
    start_epoch, history = _restore(model, spec, hvd)
    folder = tempfile.TemporaryDirectory(prefix="ringtrain-keras-best-")
    checkpointer = _checkpointer(spec, hvd.rank(), folder.name)
    with folder, _local_copies(spec) as (train_path, val_path):  # type: ignore[arg-type]
        val = _validation(spec, val_path, hvd.rank(), hvd.size())
        with open_training(
            spec.store,
            train_path,
            rank=hvd.rank(),
            size=hvd.size(),
            batch_size=spec.batch_size,
            columns=_columns(spec),
            reader=spec.reader,
            shuffle=spec.shuffle,
            seed=spec.seed,
            workers_count=spec.reader_workers,
            pool_type=spec.reader_pool,
        ) as reader:
            model.fit(
                _dataset(spec, iter(reader)),
                steps_per_epoch=spec.steps_per_epoch,
                epochs=spec.epochs,
                initial_epoch=start_epoch,
                validation_data=val,  # batched already: val_batch_size rows each
                verbose=0,
                shuffle=False,  # the reader shuffles (spec.shuffle); Keras cannot shuffle a stream
                callbacks=[
                    hvd.callbacks.BroadcastGlobalVariablesCallback(0),
                    hvd.callbacks.MetricAverageCallback(),
                    _epoch_callback(spec, history, hvd.rank()),
                    *keras_progress_callbacks(spec, hvd.rank(), history),  # rank 0: progress, TB
                    *(cloudpickle.loads(spec.callbacks) if spec.callbacks else []),
                    *([checkpointer] if checkpointer is not None else []),
                ],
            )
        _keep_best(spec, checkpointer)
    return history if hvd.rank() == 0 else None


# --- driver: inference in Arrow batches, persistence ------------------------------------------


def _outputs(result: Any, count: int) -> list[np.ndarray]:
    outs = [result] if not isinstance(result, list | tuple) else list(result)
    if len(outs) != count:
        raise ValueError(
            f"the Keras model returned {len(outs)} output(s) but label_cols names {count}"
        )
    return [np.asarray(o, np.float64) for o in outs]


def _to_arrow(values: np.ndarray, rows: int, kind: DataType) -> pa.Array:
    values = values.reshape(rows, -1)
    if isinstance(kind, DoubleType):
        return pa.array(values[:, 0], type=pa.float64())
    width = values.shape[1]
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=pa.float64()))


def _inputs(columns: dict[str, np.ndarray], staged: list[str]) -> Any:
    feats = [np.asarray(columns[c], np.float32) for c in staged]
    feats = [f.reshape(-1, 1) if f.ndim == 1 else f for f in feats]
    return feats[0] if len(feats) == 1 else feats


def keras_predictor(
    model: Any, shapes: list[list[int]], staged: list[str], keep: int, names: list[str]
) -> tuple[list[DataType], Callable[[Iterable[pa.RecordBatch]], Iterator[pa.RecordBatch]]]:
    """The output types (from one all-zero row) and the ``mapInArrow`` function: it
    loads the model once per task and predicts once per Arrow batch."""
    zeros = [np.zeros((1, *s), np.float32) for s in shapes]
    probe = _outputs(model(zeros[0] if len(zeros) == 1 else zeros, training=False), len(names))
    kinds: list[DataType] = [
        DoubleType() if o.size == 1 else ArrayType(DoubleType(), containsNull=False) for o in probe
    ]
    data, objects = model_to_bytes(model), custom_objects_of(model)

    def predict(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
        loaded = model_from_bytes(data, custom_objects=objects)
        for batch in batches:
            rows = batch.num_rows
            if rows == 0:
                empty = [
                    pa.array([], type=pa.float64())
                    if isinstance(k, DoubleType)
                    else pa.array([], type=pa.list_(pa.float64()))
                    for k in kinds
                ]
                outs = empty
            else:
                result = loaded(_inputs(to_numpy_columns(batch, staged), staged), training=False)
                outs = [
                    _to_arrow(o, rows, k)
                    for o, k in zip(_outputs(result, len(names)), kinds, strict=True)
                ]
            yield pa.RecordBatch.from_arrays(
                batch.columns[:keep] + outs, names=batch.schema.names[:keep] + names
            )

    return kinds, predict


def save_keras_model(model: Any, path: str) -> None:
    """``<path>/model/model.keras`` (Keras's own format: architecture, weights), and the
    ``custom_objects`` it was loaded with as ``custom_objects.pkl`` (cloudpickle)."""
    folder = f"{path.rstrip('/')}/model"
    with fsspec.open(f"{folder}/{_MODEL_FILE}", "wb") as f:
        f.write(model_to_bytes(model))
    objects = custom_objects_of(model)
    if objects:
        with fsspec.open(f"{folder}/{_CUSTOM_OBJECTS_FILE}", "wb") as f:
            f.write(cloudpickle.dumps(objects))


def load_keras_model(path: str) -> Any:
    folder = f"{path.rstrip('/')}/model"
    objects: dict[str, Any] = {}
    fs, objects_path = fsspec.core.url_to_fs(f"{folder}/{_CUSTOM_OBJECTS_FILE}")
    if fs.exists(objects_path):
        with fs.open(objects_path, "rb") as f:
            objects = cloudpickle.loads(f.read())
    with fsspec.open(f"{folder}/{_MODEL_FILE}", "rb") as f:
        return model_from_bytes(f.read(), custom_objects=objects)
