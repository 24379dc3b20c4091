"""Keras models as bytes and files: ``.keras`` (architecture, weights) and custom objects.

A Keras model crosses to the workers as the bytes of a ``.keras`` file (not cloudpickle)
and is saved by ``RingModel.save`` as ``<path>/model/model.keras``. A model with custom
layers, losses or metrics loads with the ``custom_objects`` param (Horovod's: name ->
class or function); a model remembers the ``custom_objects`` it was loaded with
(:func:`custom_objects_of`) for its later loads (``transform``'s tasks,
``RingModel.save``, which writes them beside it, cloudpickled). Classes registered with
``keras.saving.register_keras_serializable`` need nothing.
"""

from __future__ import annotations

import os
import tempfile
import weakref
from typing import Any

import cloudpickle
import fsspec

__all__ = [
    "custom_objects_of",
    "load_keras_model",
    "model_from_bytes",
    "model_to_bytes",
    "save_keras_model",
]

MODEL_FILE = "model.keras"
_CUSTOM_OBJECTS_FILE = "custom_objects.pkl"


def model_to_bytes(model: Any) -> bytes:
    with tempfile.TemporaryDirectory(prefix="ringtrain-keras-") as tmp:
        path = os.path.join(tmp, MODEL_FILE)
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
        path = os.path.join(tmp, MODEL_FILE)
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


def save_keras_model(model: Any, path: str) -> None:
    """``<path>/model/model.keras`` (Keras's own format: architecture, weights), and the
    ``custom_objects`` it was loaded with as ``custom_objects.pkl`` (cloudpickle)."""
    folder = f"{path.rstrip('/')}/model"
    with fsspec.open(f"{folder}/{MODEL_FILE}", "wb") as f:
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
    with fsspec.open(f"{folder}/{MODEL_FILE}", "rb") as f:
        return model_from_bytes(f.read(), custom_objects=objects)
