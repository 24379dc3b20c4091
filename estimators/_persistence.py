"""Spark ML persistence of a :class:`RingModel`: ``save(path)`` / ``RingModel.load(path)``.

Layout under ``path`` (a local path or a URL Spark and fsspec both understand)::

    <path>/metadata/          Spark ML's JSON metadata (DefaultParamsWriter): class, uid,
                              the JSON params (history, run_id, columns, label kinds,
                              feature shapes, the store's prefix) and ``ringtrain`` extras
    <path>/model/weights.pt   torch.save of the module's state_dict (+ non-persistent buffers)
    <path>/model/module.pkl   cloudpickle of the module's *structure*, its tensors on the
                              ``meta`` device (no weights)

Why cloudpickle for the structure: a module's class is often defined in a notebook or a
training script that the loading process cannot import; cloudpickle stores such a class
by value and an importable one by reference, so both load. The weights themselves are
read with ``torch.load(weights_only=True)``, which runs no pickled code. Loading
``module.pkl`` does run pickled code: load only models you trust (as with any pickle).
A store's ``storage_options`` (credentials, often) are not saved; a loaded model's
store is re-created from its prefix alone.

Because the writer and reader follow ``DefaultParamsWriter``'s metadata, a fitted
``PipelineModel`` holding a ``RingModel`` saves and loads like any other.
"""

from __future__ import annotations

import copy
import io
import posixpath
from typing import TYPE_CHECKING, Any

import cloudpickle
import fsspec
import torch
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from ._frameworks import FRAMEWORKS, KERAS, TORCH, framework_of
from ._store import Store

if TYPE_CHECKING:
    from ._model import RingModel

__all__ = ["RingModelReader", "RingModelWriter"]

FORMAT_VERSION = 1
_JSON_PARAMS = (
    "history",
    "run_id",
    "feature_cols",
    "label_cols",
    "label_kinds",
    "output_cols",
    "feature_shapes",
    "use_gpu",
)


def _join(path: str, *parts: str) -> str:
    return posixpath.join(path.rstrip("/"), *parts)


def _extra_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers ``state_dict`` leaves out (registered with ``persistent=False``)."""
    saved = module.state_dict()
    return {
        name: buf.detach().clone()
        for name, buf in module.named_buffers()
        if name not in saved and buf is not None
    }


def _structure(module: torch.nn.Module) -> bytes:
    """The module without its weights: a copy on the ``meta`` device, cloudpickled."""
    skeleton = copy.deepcopy(module).to("meta")
    return cloudpickle.dumps(skeleton)


def save_module(module: torch.nn.Module, path: str) -> None:
    weights = io.BytesIO()
    torch.save(
        {"state_dict": module.state_dict(), "extra_buffers": _extra_buffers(module)}, weights
    )
    with fsspec.open(_join(path, "model", "weights.pt"), "wb") as f:
        f.write(weights.getvalue())
    with fsspec.open(_join(path, "model", "module.pkl"), "wb") as f:
        f.write(_structure(module))


def load_module(path: str) -> torch.nn.Module:
    with fsspec.open(_join(path, "model", "module.pkl"), "rb") as f:
        module = cloudpickle.loads(f.read())
    with fsspec.open(_join(path, "model", "weights.pt"), "rb") as f:
        saved = torch.load(io.BytesIO(f.read()), weights_only=True)
    module = module.to_empty(device="cpu")
    module.load_state_dict(saved["state_dict"], strict=True)
    for name, value in saved["extra_buffers"].items():
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner).register_buffer(attr, value, persistent=False)
    module.eval()
    return module


class RingModelWriter(MLWriter):
    """Writes a :class:`RingModel`; ``model.write().overwrite().save(path)`` replaces."""

    def __init__(self, instance: RingModel):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        model = self.instance
        module = model.getModel()
        if module is None:
            raise ValueError("this RingModel holds no model to save; set it with setModel.")
        kind = framework_of(module)
        params: dict[str, Any] = {
            name: model.getOrDefault(name) for name in _JSON_PARAMS if model.isSet(name)
        }
        store = model.getStore()
        if store is not None:
            params["store"] = store.prefix_path
        extra = {
            "ringtrain": {
                "format": FORMAT_VERSION,
                "framework": kind,
                "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
            }
        }
        DefaultParamsWriter.saveMetadata(
            model, path, self.sparkSession, extraMetadata=extra, paramMap=params
        )
        if kind == KERAS:  # Keras: <path>/model/model.keras (_train_keras.py)
            from ._train_keras import save_keras_model

            save_keras_model(module, path)
            return
        # torch nn.Module and LightningModule: weights + structure (save_module).
        save_module(module, path)


class RingModelReader(MLReader["RingModel"]):
    """Reads what :class:`RingModelWriter` wrote: ``RingModel.load(path)``."""

    def __init__(self, cls: type[RingModel]):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> RingModel:
        """The RingModel saved at ``path``.

        This unpickles ``<path>/model/module.pkl`` (cloudpickle; a Keras model: its
        ``.keras`` file), which runs any code the file holds: load only models you
        trust, from a path only you can write (as ``torch.load(weights_only=False)``).
        ``PipelineModel.load`` of a pipeline holding a RingModel calls this."""
        metadata = DefaultParamsReader.loadMetadata(path, self.sparkSession)
        version = metadata.get("ringtrain", {}).get("format")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{path} holds a RingModel of format {version!r}; this ringtrain reads format "
                f"{FORMAT_VERSION}. Load it with the ringtrain version that saved it."
            )
        params = dict(metadata["paramMap"])
        store = params.pop("store", None)
        kind = metadata["ringtrain"].get("framework", TORCH)  # format 1 before Keras: torch
        if kind not in FRAMEWORKS:
            raise ValueError(f"{path} holds a model of unknown framework {kind!r}.")
        if kind == KERAS:  # Keras: <path>/model/model.keras (_train_keras.py)
            from ._train_keras import load_keras_model

            module = load_keras_model(path)
        else:
            module = load_module(path)  # torch and lightning
        instance = self.cls(model=module, **params)
        if store is not None:
            instance.setStore(Store.create(store))
        instance._resetUid(metadata["uid"])
        return instance
