"""One run, one recipe: a fit resumes a run's checkpoint only if that fit wrote it.

A ``run_id`` with a checkpoint resumes it. Spark ML copies params, so under
``CrossValidator`` / ``TrainValidationSplit`` a ``run_id`` the user set reaches every
grid point and every fold: without a check, each fit after the first would resume the
previous one's finished checkpoint and train nothing. So a fit records, beside its
checkpoint, a fingerprint of what it trains (``<store>/runs/<run_id>/fingerprint.json``):
the params that change what is learned (not ``epochs``: training a run further is a
resume) and the DataFrame's plan. A later fit whose fingerprint differs does not
resume that checkpoint: it runs as ``<run_id>.<fingerprint>`` (resuming that one if it
is its own), with a warning naming what differs. A run without a fingerprint (written
before this check) is resumed as before. The model's architecture is not part of it:
the model's framework refuses a checkpoint of another shape outright
(``Framework.check_resume``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from collections.abc import Mapping
from typing import Any

from ._store import Store

log = logging.getLogger("ringtrain.estimators")

__all__ = ["record_run", "run_params", "run_to_use"]

FINGERPRINT_FILE = "fingerprint.json"
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _describe(value: Any) -> Any:
    """A stable, JSON-able description: functions by name, objects by class and repr
    (without memory addresses), optimizers by class and hyper-parameters."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    groups = getattr(value, "param_groups", None)
    if isinstance(groups, list):  # a torch optimizer: its hyper-parameters, not its tensors
        return {
            "class": type(value).__qualname__,
            "groups": [{k: repr(v) for k, v in sorted(g.items()) if k != "params"} for g in groups],
        }
    name = getattr(value, "__qualname__", None)
    if callable(value) and name is not None:
        return f"{getattr(value, '__module__', '')}.{name}"
    return f"{type(value).__qualname__}:{_ADDRESS.sub('', repr(value))}"


# the params of the table that change what is learned, beside the fit's config; not the
# ones that only change what is kept or reported (restore_best_weights, backend_env, ...)
_LEARNING_PARAMS = (
    "loss_weights",
    "loss_constructors",
    "train_minibatch_fn",
    "gradient_compression",
    "lr_scheduler",
    "lr_scheduler_interval",
    "precision",
    "gradient_clip_val",
    "gradient_clip_algorithm",
    "monitor",
    "monitor_mode",
    "early_stopping_patience",
    "early_stopping_min_delta",
)


def _describe_scheduler(value: Any) -> Any:
    """A scheduler by class and settings (its state but the optimizer and counters)."""
    state = getattr(value, "__dict__", None)
    if state is None or not hasattr(value, "optimizer"):
        return _describe(value)
    skip = {"optimizer", "last_epoch", "_step_count", "_last_lr", "_get_lr_called_within_step"}
    return {
        "class": type(value).__qualname__,
        "settings": {k: _describe(v) for k, v in sorted(state.items()) if k not in skip},
    }


def run_params(cfg: Any, values: Mapping[str, Any], df: Any = None) -> dict[str, Any]:
    """What a fit of ``cfg`` on ``df`` (None: Parquet already in the store) trains;
    ``values``: the estimator's params (``trainer_args``, a LightningModule's Trainer
    arguments, counts when set)."""
    params = {
        name: _describe(getattr(cfg, name))
        for name in (
            "optimizer",
            "loss",
            "metrics",
            "feature_cols",
            "label_cols",
            "validation",
            "sample_weight_col",
            "transformation_fn",
            "batch_size",
            "shuffle",
            "split_seed",
            "train_steps_per_epoch",
            "backward_passes_per_step",
        )
    }
    params["framework"] = cfg.framework.name
    for name in _LEARNING_PARAMS:
        value = values[name]
        params[name] = _describe_scheduler(value) if name == "lr_scheduler" else _describe(value)
    trainer_args = values.get("trainer_args")
    if trainer_args:
        params["trainer_args"] = {k: _describe(v) for k, v in sorted(trainer_args.items())}
    if df is not None:
        params["data"] = (
            f"{df.semanticHash()}:{hashlib.sha256(df.schema.json().encode()).hexdigest()[:16]}"
        )
    return params


def _fingerprint(params: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()


def _path(store: Store, run_id: str) -> str:
    return f"{store.get_run_path(run_id)}/{FINGERPRINT_FILE}"


def _recorded(store: Store, run_id: str) -> dict[str, Any] | None:
    path = _path(store, run_id)
    if not store.exists(path):
        return None
    try:
        value = store.read_json(path)
    except (OSError, ValueError):
        return None
    return value.get("params") if isinstance(value, dict) else None


def _difference(old: dict[str, Any], new: dict[str, Any]) -> str:
    keys = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
    return ", ".join(f"{k}: {old.get(k)!r} then, {new.get(k)!r} now" for k in keys[:4])


def run_to_use(store: Store, run_id: str, params: dict[str, Any]) -> str:
    """``run_id``, or ``<run_id>.<fingerprint>`` when ``run_id`` holds the checkpoint of a
    fit with other params (or data)."""
    if store.find_checkpoint(run_id) is None:
        return run_id
    old = _recorded(store, run_id)
    if old is None or _fingerprint(old) == _fingerprint(params):
        return run_id
    own = f"{run_id}.{_fingerprint(params)[:12]}"
    log.warning(
        "run_id %r holds the checkpoint of a fit with other params (%s), so this fit does "
        "not resume it and runs as %r instead. Under CrossValidator or TrainValidationSplit "
        "leave run_id unset, so that every fit gets its own run.",
        run_id,
        _difference(old, params),
        own,
    )
    return own


def record_run(store: Store, run_id: str, params: dict[str, Any]) -> None:
    """Write the run's fingerprint (before its workers write a checkpoint)."""
    old = _recorded(store, run_id)
    if old is None or _fingerprint(old) != _fingerprint(params):
        store.write_json(
            _path(store, run_id), {"fingerprint": _fingerprint(params), "params": params}
        )
