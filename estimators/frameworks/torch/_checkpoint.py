"""The torch framework's checkpoints and saved models.

- **Checkpoints.** The run's ``checkpoint.pt`` (``torch.save``, written by rank 0 after
  each epoch) holds the model's ``state_dict``, the optimizer's, the epoch, the history
  and, with ``restore_best_weights``, the best epoch's weights. :func:`load_checkpoint`
  gives the trained model; :func:`check_resume` refuses, before any job, a model whose
  parameters do not match the checkpoint a fit would resume.
- **Saved models** (``RingModel.save``): the weights (``torch.save``: state_dict and
  non-persistent buffers) and the module's structure (cloudpickle, on the ``meta``
  device) under ``<path>/model/`` (layout: ``estimators._persistence``).
"""

from __future__ import annotations

import copy
import io
import posixpath
from typing import Any

import cloudpickle
import fsspec
import torch

from ...store._checkpoints import read_checkpoint

__all__ = ["check_resume", "checkpoint_epoch", "load_checkpoint", "load_module", "save_module"]


def load_checkpoint(cfg: Any) -> torch.nn.Module:
    """The trained model of the run's final checkpoint: a copy of ``cfg.model`` with its
    weights (the best epoch's with ``restore_best_weights``, when the run kept one)."""
    raw = read_checkpoint(cfg.store, cfg.run_id)  # the newest whole one: a torn one is passed
    # map_location: a checkpoint of an older run may hold CUDA tensors; the driver may have no GPU
    checkpoint = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    model = copy.deepcopy(cfg.model)
    best = checkpoint.get("best")
    config = getattr(cfg, "framework_config", None)
    restore_best = bool(getattr(config, "restore_best_weights", False)) and best is not None
    model.load_state_dict(best["model"] if restore_best else checkpoint["model"])
    model.eval()
    return model


def checkpoint_epoch(data: bytes) -> int:
    """The epochs done that a checkpoint (its bytes) holds."""
    checkpoint = torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    return int(checkpoint["epoch"])


def _state_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"this model has {', '.join(missing[:3])} which the checkpoint lacks")
        if extra:
            parts.append(f"the checkpoint has {', '.join(extra[:3])} which this model lacks")
        return "; ".join(parts)
    for key, value in current.items():
        old = saved[key]
        if hasattr(value, "shape") and hasattr(old, "shape") and value.shape != old.shape:
            return (
                f"parameter {key!r} has shape {list(old.shape)} in the checkpoint but "
                f"{list(value.shape)} in this model"
            )
    return None


def check_resume(model: Any, store: Any, run_id: str, path: str) -> None:
    """A ``run_id`` with a checkpoint (at ``path``) resumes it: ``model`` must have the
    same parameters."""
    try:
        if store.is_local():
            checkpoint = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        else:
            checkpoint = torch.load(
                io.BytesIO(store.read_bytes(path)), weights_only=True, map_location="cpu"
            )
    except Exception as exc:
        raise ValueError(
            f"run_id {run_id!r} has a checkpoint at {path} that cannot be read "
            f"({type(exc).__name__}: {exc}); a fit with this run_id would resume from it. Pick "
            f"a new run_id with setRunId(...), or delete {store.get_run_path(run_id)} to start over."
        ) from exc
    saved = checkpoint.get("model") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict):
        return
    difference = _state_difference(saved, model.state_dict())
    if difference:
        raise ValueError(
            f"run_id {run_id!r} already has a checkpoint at {path} from a different model "
            f"({difference}); a fit with an existing run_id resumes that run. Pick a new run_id "
            f"with setRunId(...), or delete {store.get_run_path(run_id)} to start the run over."
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
    """``<path>/model/weights.pt`` (state_dict + non-persistent buffers) and ``module.pkl``."""
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
