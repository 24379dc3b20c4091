"""A Keras run's checkpoints: ``.keras`` files with the history inside, and the best one.

Rank 0 writes the model as the run's checkpoint after every epoch, with the history so
far as a member of its zip (:func:`with_history`; Keras ignores it), so a resume from
it, or from the previous one when it is torn, knows which epochs it holds
(:func:`history_in`). ``checkpoint_callback`` (Horovod's ``ModelCheckpoint``) saves
into the run as ``best.keras`` (or ``best.weights.h5``): :func:`load_keras_checkpoint`
returns what it saved last when it saved anything, else the final checkpoint.
"""

from __future__ import annotations

import io
import json
import os
import tempfile
import zipfile
from typing import Any

from ...store._checkpoints import read_checkpoint
from ._model_io import model_from_bytes

__all__ = ["best_path", "checkpoint_epoch", "history_in", "load_keras_checkpoint", "with_history"]

HISTORY_MEMBER = "ringtrain_history.json"


def with_history(data: bytes, history: list[dict[str, Any]]) -> bytes:
    """A zip checkpoint (a ``.keras`` file) with the run's history added as a member
    (Keras ignores it), so a resume from it, or from the previous one when it is torn,
    knows which epochs it holds."""
    buffer = io.BytesIO(data)
    with zipfile.ZipFile(buffer, "a") as archive:
        archive.writestr(HISTORY_MEMBER, json.dumps(history))
    return buffer.getvalue()


def history_in(data: bytes) -> list[dict[str, Any]] | None:
    """The history :func:`with_history` put in a checkpoint (None: one written before)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        if HISTORY_MEMBER not in archive.namelist():
            return None
        return list(json.loads(archive.read(HISTORY_MEMBER)))


def checkpoint_epoch(data: bytes) -> int:
    """The epochs done that a checkpoint holds (the length of its history)."""
    history = history_in(data)
    if history is None:
        raise ValueError("it holds no history (an older ringtrain wrote it)")
    return len(history)


def best_path(spec_or_cfg: Any, weights_only: bool) -> str:
    """Where the run keeps what ``checkpoint_callback`` saved."""
    name = "best.weights.h5" if weights_only else "best.keras"
    return f"{spec_or_cfg.store.get_run_path(spec_or_cfg.run_id)}/{name}"


def load_keras_checkpoint(cfg: Any) -> Any:
    """The trained Keras model (not compiled): what ``checkpoint_callback`` saved last when
    it is set and saved anything, else the run's final checkpoint."""
    config = cfg.framework_config
    objects = dict(config.custom_objects)
    store = cfg.store
    model = model_from_bytes(read_checkpoint(store, cfg.run_id), custom_objects=objects)
    callback = config.checkpoint_callback
    if callback is None:
        return model
    weights_only = bool(getattr(callback, "save_weights_only", False))
    best = best_path(cfg, weights_only)
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
