"""What a Keras worker gets from the driver: the :class:`KerasSpec` of a fit.

The model travels as ``.keras`` bytes; the optimizer (a param, or the one
``model.compile`` was given) as its config, the loss and the metrics as Keras configs
or as they are (strings, plain functions), cloudpickled together; the user's Keras
callbacks, ``custom_objects`` and ``checkpoint_callback`` cloudpickled.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import cloudpickle

from ...data._spec import DataSpec, data_spec_fields
from ._config import KerasConfig, compiled
from ._model_io import model_to_bytes

__all__ = ["KerasSpec", "deserialized", "keras_spec"]


@dataclass(frozen=True, kw_only=True)
class KerasSpec(DataSpec):
    """Everything a Keras worker needs, as picklable data."""

    model_bytes: bytes  # the model as a .keras file
    compile_objects: bytes  # cloudpickle of (optimizer config, loss, metrics)
    callbacks: bytes = b""  # cloudpickle of the user's keras.callbacks.Callback list
    custom_objects: bytes = b""  # cloudpickle of {name: class or function} (Horovod's)
    prefetch: int = 1  # batches the tf.data pipeline prefetches (0: none)
    checkpoint_callback: bytes = b""  # cloudpickle of a keras ModelCheckpoint (rank 0 runs it)


def _serializable(value: Any) -> Any:
    """Keras objects as their config; strings and plain functions as they are."""
    import keras

    if isinstance(value, list | tuple):
        return [_serializable(v) for v in value]
    if isinstance(value, keras.losses.Loss | keras.metrics.Metric):
        return {"__keras__": keras.saving.serialize_keras_object(value)}
    return value


def deserialized(value: Any) -> Any:
    import keras

    if isinstance(value, list):
        return [deserialized(v) for v in value]
    if isinstance(value, dict) and "__keras__" in value:
        return keras.saving.deserialize_keras_object(value["__keras__"])
    return value


def keras_spec(cfg: Any, data: Any) -> KerasSpec:
    """The :class:`KerasSpec` of a fit of ``cfg`` on ``data``."""
    import keras

    given = compiled(cfg.model)
    optimizer = cfg.optimizer if cfg.optimizer is not None else given["optimizer"]
    optimizer = keras.optimizers.get(optimizer) if isinstance(optimizer, str) else optimizer
    loss = cfg.loss if cfg.loss is not None else given.get("loss")
    metrics = list(cfg.metrics) or list(given.get("metrics") or [])
    objects = (keras.optimizers.serialize(optimizer), _serializable(loss), _serializable(metrics))
    config = getattr(cfg, "framework_config", None) or KerasConfig()
    return KerasSpec(
        model_bytes=model_to_bytes(cfg.model),
        compile_objects=cloudpickle.dumps(objects),
        **data_spec_fields(cfg, data),
        callbacks=cloudpickle.dumps(list(cfg.callbacks)),
        custom_objects=cloudpickle.dumps(dict(config.custom_objects)),
        prefetch=config.tensorflow_dataset_prefetch_buffer_size,
        checkpoint_callback=(
            cloudpickle.dumps(config.checkpoint_callback) if config.checkpoint_callback else b""
        ),
    )
