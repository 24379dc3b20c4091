"""A trained Hugging Face model and its tokenizer in Hugging Face's own formats.

Under ``<path>/model/`` (no pickle in either):

- ``hf/`` holds what ``save_pretrained`` writes. A ``PreTrainedModel``: ``config.json``
  and the weights (``model.safetensors``). A ``peft.PeftModel``: only its adapters, as
  PEFT writes them (``adapter_config.json``, ``adapter_model.safetensors``), and the base
  model's ``config.json``; the base weights are not copied. On load they come from where
  PEFT's own loaders (``AutoPeftModel.from_pretrained``) take them: the adapter config's
  ``base_model_name_or_path`` (the hub name or folder the base was ``from_pretrained``
  from), read with the saved config (so a head sized at fit, ``num_labels``, fits the
  adapters' copy of it); then ``PeftModel.from_pretrained`` puts the adapters on it.
- ``class.json``: the model's class (``module``, ``qualname``; of the base model, with
  ``"peft": true``, for a PeftModel), so it reloads as the same class.
- ``tokenizer/`` and ``tokenizer_class.json``: the ``tokenizer`` param's
  ``save_pretrained`` (``tokenizer.json``, ``tokenizer_config.json``, ...) and its
  class, reloaded with that class's ``from_pretrained``.

A path fsspec reaches but the filesystem does not (``s3://``) goes through a local
temporary folder.
"""

from __future__ import annotations

import importlib
import json
import posixpath
import tempfile
from typing import Any

import fsspec

from ._peft import base_of, is_peft_model

__all__ = ["load_pretrained", "load_tokenizer", "save_pretrained", "save_tokenizer"]


def _folder(path: str) -> str:
    return posixpath.join(path.rstrip("/"), "model")


def _write_class(fs: Any, file: str, cls: type, **extra: Any) -> None:
    with fs.open(file, "w") as f:
        json.dump({"module": cls.__module__, "qualname": cls.__qualname__, **extra}, f)


def _read_class(fs: Any, file: str) -> tuple[Any, dict[str, Any]]:
    with fs.open(file, "r") as f:
        named = json.load(f)
    cls: Any = importlib.import_module(named["module"])
    for part in named["qualname"].split("."):
        cls = getattr(cls, part)
    return cls, named


def _base_source(model: Any) -> str:
    """Where a PeftModel's base weights are reloaded from (PEFT's ``base_model_name_or_path``)."""
    config = model.peft_config[model.active_adapter]
    source = config.base_model_name_or_path or getattr(base_of(model), "name_or_path", "")
    if not source:
        raise ValueError(
            f"the {type(model).__name__}'s base model ({type(base_of(model)).__name__}) was not "
            "loaded with from_pretrained, so the saved adapters would name no base weights to "
            "reload them onto (only the adapters and the base's config are saved). Save the base "
            "with base.save_pretrained(folder) and build the PeftModel on "
            "from_pretrained(folder), or set model.peft_config["
            f"{model.active_adapter!r}].base_model_name_or_path to a folder or hub name "
            "holding its weights."
        )
    return str(source)


def check_saveable(model: Any) -> None:
    """Raise, naming the fix, if :func:`save_pretrained` could not save ``model`` (a
    PeftModel whose base weights nothing names)."""
    if is_peft_model(model):
        _base_source(model)


def save_pretrained(model: Any, path: str) -> None:
    """``model.save_pretrained`` into ``<path>/model/hf`` and its class beside it (a
    PeftModel: its adapters and the base model's config; see the module docstring)."""
    fs, root = fsspec.core.url_to_fs(_folder(path))
    peft = is_peft_model(model)
    if peft:
        _base_source(model)  # a base with no weights to name is refused before any write
    with tempfile.TemporaryDirectory() as local:
        model.save_pretrained(local)
        if peft:
            base_of(model).config.save_pretrained(local)
        fs.put(local, posixpath.join(root, "hf"), recursive=True)
    if peft:
        _write_class(fs, posixpath.join(root, "class.json"), type(base_of(model)), peft=True)
    else:
        _write_class(fs, posixpath.join(root, "class.json"), type(model))


def _load_peft(cls: Any, local: str) -> Any:
    from peft import PeftConfig, PeftModel

    source = PeftConfig.from_pretrained(local).base_model_name_or_path
    base = cls.from_pretrained(source, config=cls.config_class.from_pretrained(local))
    return PeftModel.from_pretrained(base, local)


def load_pretrained(path: str) -> Any:
    """The model :func:`save_pretrained` wrote, as its class, in eval mode on the CPU."""
    fs, root = fsspec.core.url_to_fs(_folder(path))
    cls, named = _read_class(fs, posixpath.join(root, "class.json"))
    with tempfile.TemporaryDirectory() as local:
        fs.get(posixpath.join(root, "hf") + "/", local, recursive=True)
        model = _load_peft(cls, local) if named.get("peft") else cls.from_pretrained(local)
    model.eval()
    return model


def save_tokenizer(tokenizer: Any, path: str) -> bool:
    """``tokenizer.save_pretrained`` into ``<path>/model/tokenizer`` and its class beside
    it; False (nothing written) for a tokenizer without ``save_pretrained``."""
    if not callable(getattr(tokenizer, "save_pretrained", None)):
        return False
    fs, root = fsspec.core.url_to_fs(_folder(path))
    with tempfile.TemporaryDirectory() as local:
        tokenizer.save_pretrained(local)
        fs.put(local, posixpath.join(root, "tokenizer"), recursive=True)
    _write_class(fs, posixpath.join(root, "tokenizer_class.json"), type(tokenizer))
    return True


def load_tokenizer(path: str) -> Any:
    """The tokenizer :func:`save_tokenizer` wrote, as its class; None where it wrote none."""
    fs, root = fsspec.core.url_to_fs(_folder(path))
    named = posixpath.join(root, "tokenizer_class.json")
    if not fs.exists(named):
        return None
    cls, _ = _read_class(fs, named)
    with tempfile.TemporaryDirectory() as local:
        fs.get(posixpath.join(root, "tokenizer") + "/", local, recursive=True)
        return cls.from_pretrained(local)
