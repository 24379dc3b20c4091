"""The Keras worker: ``train_keras(spec)``, Keras's own ``model.fit`` on the ring.

1. ``ringcore.keras.init()``; rebuild the model from its ``.keras`` bytes, compile it
   with the optimizer (from its config) wrapped in ``DistributedOptimizer``, the loss
   and the metrics, and build the optimizer's state on every rank (a built model).
2. Resume from the run's checkpoint when there is one (rank 0 reads it; the
   broadcast callback gives every rank rank 0's weights and optimizer state at
   ``on_train_begin``: every rank broadcasts the same variables, its optimizer built).
3. ``model.fit`` on a ``tf.data`` pipeline over this rank's shard (``_data``: sharded by
   rank, the same ``steps_per_epoch`` on every rank), validating on the rank's
   validation shard (streamed from the store once per epoch, never held whole);
   ``MetricAverageCallback`` averages the metrics over the ranks (each rank's
   validation mean weighs the same: the shards differ by one row at most); the user's
   ``callbacks`` (Keras callbacks) run after these, on every rank.
4. Rank 0 writes the model (``.keras``, with the history so far inside:
   ``_checkpoint.with_history``) as the run's checkpoint and the history (the torch
   loop's format: ``train_<metric>``, ``val_<metric>``, ``epoch``, ``seconds``) to the
   Store after every epoch, and feeds the live progress; a resume takes its epochs from
   the checkpoint it loads. ``checkpoint_callback`` (Horovod's ``ModelCheckpoint``) runs
   on rank 0 with its ``filepath`` in a folder of its own; what it saved last goes into
   the run (``best.keras``) after the fit.
"""

from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import cloudpickle

from ...data._batches import columns_of
from ...data._readers import data_paths, open_training
from ...data._spec import writer
from ...tracking._progress import StepReporter
from ._checkpoint import best_path, history_in, with_history
from ._data import dataset, validation_dataset
from ._model_io import model_from_bytes, model_to_bytes
from ._spec import KerasSpec, deserialized

__all__ = ["train_keras"]


def _set_threads(local_size: int) -> None:
    import tensorflow as tf

    try:  # only possible before TensorFlow's runtime starts
        tf.config.threading.set_intra_op_parallelism_threads(
            max(1, (os.cpu_count() or 1) // local_size)
        )
        tf.config.threading.set_inter_op_parallelism_threads(2)
    except RuntimeError:
        pass


def _rebuild(spec: KerasSpec, hvd: Any) -> Any:
    import keras

    model = model_from_bytes(spec.model_bytes, custom_objects=_objects(spec))
    optimizer_config, loss, metrics = cloudpickle.loads(spec.compile_objects)
    optimizer = hvd.DistributedOptimizer(
        keras.optimizers.deserialize(optimizer_config),
        backward_passes_per_step=spec.backward_passes_per_step,
    )
    model.compile(
        optimizer=optimizer,
        loss=deserialized(loss),
        metrics=deserialized(metrics),
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


def _restore(model: Any, spec: KerasSpec, hvd: Any) -> tuple[int, list[dict[str, Any]]]:
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


def _objects(spec: KerasSpec) -> dict[str, Any]:
    return cloudpickle.loads(spec.custom_objects) if spec.custom_objects else {}


def _checkpointer(spec: KerasSpec, rank: int, folder: str) -> Any:
    """Rank 0's ``checkpoint_callback`` writing into ``folder`` (None: not set or rank > 0)."""
    if not spec.checkpoint_callback or rank != 0:
        return None
    callback = cloudpickle.loads(spec.checkpoint_callback)
    weights_only = bool(getattr(callback, "save_weights_only", False))
    callback.filepath = os.path.join(folder, os.path.basename(best_path(spec, weights_only)))
    return callback


def _keep_best(spec: KerasSpec, callback: Any) -> None:
    """What ``checkpoint_callback`` saved last, into the run (rank 0, after the fit)."""
    if callback is not None and os.path.exists(callback.filepath):
        weights_only = bool(getattr(callback, "save_weights_only", False))
        with open(callback.filepath, "rb") as f:
            spec.store.write_bytes(best_path(spec, weights_only), f.read())


def _epoch_callback(spec: KerasSpec, history: list[dict[str, Any]], rank: int) -> Any:
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


def train_keras(spec: KerasSpec) -> list[dict[str, Any]] | None:
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
    with folder, data_paths(spec.store, spec.train_path, spec.val_path) as (train_path, val_path):
        val = validation_dataset(spec, val_path, hvd.rank(), hvd.size())
        with open_training(
            spec.store,
            train_path,
            rank=hvd.rank(),
            size=hvd.size(),
            batch_size=spec.batch_size,
            columns=columns_of(spec),
            reader=spec.reader,
            shuffle=spec.shuffle,
            seed=spec.seed,
            workers_count=spec.reader_workers,
            pool_type=spec.reader_pool,
        ) as reader:
            model.fit(
                dataset(spec, iter(reader)),
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
                    *_progress_callbacks(spec, hvd.rank(), history),  # rank 0: progress, TB
                    *(cloudpickle.loads(spec.callbacks) if spec.callbacks else []),
                    *([checkpointer] if checkpointer is not None else []),
                ],
            )
        _keep_best(spec, checkpointer)
    return history if hvd.rank() == 0 else None


def _progress_callbacks(spec: Any, rank: int, history: list[dict[str, Any]]) -> list[Any]:
    """A Keras callback of rank 0 feeding a :class:`StepReporter` (Keras's ``loss`` in
    ``logs`` is the epoch's running mean), or none on other ranks. It goes after the
    callback that appends each epoch's entry to ``history``."""
    if rank != 0:
        return []
    import keras

    reporter = StepReporter(spec.store, spec.run_id, spec.epochs, spec.steps_per_epoch)
    batch_size = float(spec.batch_size)

    class KerasProgress(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            reporter.begin_epoch(epoch)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            reporter.step(batch, float((logs or {}).get("loss", float("nan"))), batch_size)

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            if history:
                reporter.end_epoch(epoch, history[-1])

        def on_train_end(self, logs: Any = None) -> None:
            reporter.close()

    return [KerasProgress()]
