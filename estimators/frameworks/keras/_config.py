"""A Keras model's params and its part of a fit's config, checked on the driver.

A Keras model needs an optimizer and a loss, as params or from ``model.compile``
(:func:`check_keras`). The Keras-only params (:data:`KERAS_PARAMS`: ``custom_objects``,
``tensorflow_dataset_prefetch_buffer_size``, ``checkpoint_callback``) are refused for
another framework's model and read into a frozen :class:`KerasConfig` for a Keras one
(:func:`keras_config`), checked before any job with the callbacks, which must be Keras
callbacks. TensorFlow / Keras are imported inside the functions only.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KERAS_PARAMS", "KerasConfig", "check_keras", "compiled", "keras_config"]


@dataclass(frozen=True)
class KerasConfig:
    """The Keras-only params of one fit (see the params table for each)."""

    custom_objects: dict[str, Any] = field(default_factory=dict)
    tensorflow_dataset_prefetch_buffer_size: int = 1
    checkpoint_callback: Any = None


KERAS_PARAMS: Mapping[str, Any] = {
    "custom_objects": {},
    "tensorflow_dataset_prefetch_buffer_size": 1,
    "checkpoint_callback": None,
}


def compiled(model: Any) -> dict[str, Any]:
    """What ``model.compile`` was given (optimizer, loss, metrics), or {} uncompiled."""
    config = getattr(model, "_compile_config", None)
    return dict(config.config) if config is not None and model.compiled else {}


def check_keras(model: Any, optimizer: Any, loss: Any) -> None:
    """A Keras model needs an optimizer and a loss: as params, or from ``model.compile``."""
    import keras

    given = compiled(model)
    optimizer = optimizer if optimizer is not None else given.get("optimizer")
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
    if (loss if loss is not None else given.get("loss")) is None:
        raise ValueError(
            "the Keras model has no loss: compile it with loss=... or pass "
            "setLoss('sparse_categorical_crossentropy'), for example."
        )


def _check_callbacks(callbacks: list[Any], checkpoint_callback: Any) -> None:
    import keras

    foreign = [cb for cb in callbacks if not isinstance(cb, keras.callbacks.Callback)]
    if foreign:
        raise ValueError(
            f"callbacks of a Keras model must be keras.callbacks.Callback objects, got "
            f"{', '.join(type(cb).__name__ for cb in foreign)}. Subclass keras.callbacks.Callback."
        )
    if checkpoint_callback is None:
        return
    if not isinstance(checkpoint_callback, keras.callbacks.Callback) or not hasattr(
        checkpoint_callback, "filepath"
    ):
        raise ValueError(
            f"checkpoint_callback takes a keras.callbacks.ModelCheckpoint (Horovod's: it decides "
            f"which epoch's model fit returns), got {type(checkpoint_callback).__name__}. Pass "
            "keras.callbacks.ModelCheckpoint('best.keras', monitor='val_loss', "
            "save_best_only=True), or other callbacks with setCallbacks([...])."
        )


def keras_config(params: Mapping[str, Any], cfg: Any) -> KerasConfig:
    """The Keras-only params of a fit, checked (see the module docstring)."""
    config = KerasConfig(**{name: params[name] for name in KERAS_PARAMS})
    if config.tensorflow_dataset_prefetch_buffer_size < 0:
        raise ValueError(
            "tensorflow_dataset_prefetch_buffer_size must be >= 0 (batches; 0: no prefetch), "
            f"got {config.tensorflow_dataset_prefetch_buffer_size}."
        )
    _check_callbacks(list(cfg.callbacks), config.checkpoint_callback)
    return config
