"""LightningModule helpers: the Lightning-only params, and what the Trainer path shares.

**The Lightning-only params** (:data:`LIGHTNING_PARAMS`: ``trainer_args``, ``logger``,
``log_every_n_steps``, ``terminate_on_nan``, ``profiler``, each with the value that
means unset) configure the ``lightning.Trainer`` every worker fits a LightningModule
under (``_train_lightning.py``). :func:`with_lightning_params` runs right after the
params are resolved, before any Spark job: for a LightningModule it checks them and
carries them on the fit's config (``_framework_lightning.lightning_config``); for any
other model one of them set raises, naming it, its value and the fix. It imports
neither Lightning nor the Lightning framework module for a torch or Keras model.

**Shared with the Trainer path**: a :class:`LogRecorder` records ``self.log`` /
``self.log_dict`` (weighted sums per name and phase; their per-row means over every
rank enter the history as ``train_<name>`` / ``val_<name>``), and :func:`overrides`
tells whether a module defines one of its hooks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ._frameworks import is_lightning_module

__all__ = [
    "LIGHTNING_PARAMS",
    "RESERVED_TRAINER_ARGS",
    "LogRecorder",
    "check_reserved_trainer_args",
    "lightning_values",
    "overrides",
    "refuse_lightning_params",
    "with_lightning_params",
]

# The params only a LightningModule's Trainer reads, with the value that means "unset"
# (the params table's defaults).
LIGHTNING_PARAMS: dict[str, Any] = {
    "trainer_args": {},
    "logger": None,
    "log_every_n_steps": 50,
    "terminate_on_nan": False,
    "profiler": None,
}


# trainer_args ringtrain sets itself, and what to use instead.
RESERVED_TRAINER_ARGS: dict[str, str] = {
    "strategy": "every rank runs one Trainer on ringtrain's RingStrategy; size the job with num_proc",
    "devices": "every rank trains on one device; size the job with num_proc",
    "num_nodes": "the ranks are the Spark tasks; size the job with num_proc",
    "accelerator": "use use_gpu=True / False",
    "max_epochs": "use epochs",
    "enable_checkpointing": "ringtrain checkpoints into the store every epoch and resumes a run_id from there; a ModelCheckpoint in callbacks still writes its own files",
    "callbacks": "use the callbacks param",
    "logger": "use the logger param",
    "log_every_n_steps": "use the log_every_n_steps param",
    "profiler": "use the profiler param",
}


def check_reserved_trainer_args(trainer_args: dict[str, Any]) -> None:
    """Raise ValueError for a key of ``trainer_args`` that ringtrain sets itself."""
    for key in trainer_args:
        if key in RESERVED_TRAINER_ARGS:
            raise ValueError(
                f"trainer_args sets {key}={trainer_args[key]!r}, which RingEstimator sets "
                f"itself: {RESERVED_TRAINER_ARGS[key]}. Drop {key!r} from trainer_args."
            )


def lightning_values(est: Any) -> dict[str, Any]:
    """The Lightning-only params of ``est``; None (Horovod's default of some) is unset."""
    values = {}
    for name, unset in LIGHTNING_PARAMS.items():
        value = est.getOrDefault(name)
        values[name] = unset if value is None else value
    return values


def refuse_lightning_params(framework: str, values: dict[str, Any]) -> None:
    """Raise ValueError for the first Lightning-only param in ``values`` that is set (the
    model is a ``framework`` model, whose loop would silently ignore it)."""
    for name, unset in LIGHTNING_PARAMS.items():
        value = values.get(name, unset)
        if value is not None and value is not unset and value != unset:
            raise ValueError(
                f"{name}={value!r} is set, but the model is a {framework} model: {name} "
                "configures the lightning.Trainer of a LightningModule, which this model "
                f"is not. Unset it (setParams({name}={unset!r})) or pass a "
                "lightning.LightningModule as model."
            )


def with_lightning_params(est: Any, cfg: Any) -> Any:
    """The fit's config ``cfg`` of ``est``, checked for the Lightning-only params (see the
    module docstring): with their values for a LightningModule, as it was otherwise."""
    values = lightning_values(est)
    if not is_lightning_module(cfg.model):
        refuse_lightning_params(cfg.framework, values)
        return cfg
    from ._framework_lightning import lightning_config

    return lightning_config(cfg, values)


class LogRecorder:
    """Stands in for ``LightningModule.log``: weighted sums per name and phase."""

    def __init__(self) -> None:
        self.phase = "train"
        self.weight = 1.0  # rows of the current batch (1 outside a step)
        self.sums: dict[str, list[float]] = {}  # name -> [sum(value * weight), sum(weight)]

    def _key(self, name: str) -> str:
        if name.startswith(("train_", "val_")):
            return name
        return f"{self.phase}_{name}"

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().float().mean().item()
        entry = self.sums.setdefault(self._key(name), [0.0, 0.0])
        entry[0] += float(value) * self.weight
        entry[1] += self.weight

    def log_dict(self, values: dict[str, Any], *args: Any, **kwargs: Any) -> None:
        for name, value in values.items():
            self.log(name, value)

    def take(self) -> dict[str, np.ndarray]:
        sums, self.sums = self.sums, {}
        return {k: np.asarray(v, dtype=np.float64) for k, v in sums.items()}


def overrides(module: Any, method: str) -> bool:
    """Whether ``module``'s class defines ``method`` over ``LightningModule``'s own."""
    base = next(c for c in type(module).__mro__ if c.__name__ == "LightningModule")
    return getattr(type(module), method, None) is not getattr(base, method, None)
