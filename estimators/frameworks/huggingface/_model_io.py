"""A trained Hugging Face model in its own format: ``save_pretrained`` / ``from_pretrained``.

``<path>/model/hf/`` holds what ``save_pretrained`` writes (``config.json`` and the
weights as ``model.safetensors``: no pickle), and ``<path>/model/class.json`` the
model's class (``module`` and ``qualname``), so it reloads as the same class. A path
fsspec reaches but the filesystem does not (``s3://``) goes through a local temporary
folder.
"""

from __future__ import annotations

import importlib
import json
import posixpath
import tempfile
from typing import Any

import fsspec

__all__ = ["load_pretrained", "save_pretrained"]


def _folder(path: str) -> str:
    return posixpath.join(path.rstrip("/"), "model")


def save_pretrained(model: Any, path: str) -> None:
    """``model.save_pretrained`` into ``<path>/model/hf`` and its class beside it."""
    fs, root = fsspec.core.url_to_fs(_folder(path))
    with tempfile.TemporaryDirectory() as local:
        model.save_pretrained(local)
        fs.put(local, posixpath.join(root, "hf"), recursive=True)
    cls = type(model)
    with fs.open(posixpath.join(root, "class.json"), "w") as f:
        json.dump({"module": cls.__module__, "qualname": cls.__qualname__}, f)


def load_pretrained(path: str) -> Any:
    """The model :func:`save_pretrained` wrote, as its class, in eval mode on the CPU."""
    fs, root = fsspec.core.url_to_fs(_folder(path))
    with fs.open(posixpath.join(root, "class.json"), "r") as f:
        named = json.load(f)
    cls: Any = importlib.import_module(named["module"])
    for part in named["qualname"].split("."):
        cls = getattr(cls, part)
    with tempfile.TemporaryDirectory() as local:
        fs.get(posixpath.join(root, "hf") + "/", local, recursive=True)
        model = cls.from_pretrained(local)
    model.eval()
    return model
