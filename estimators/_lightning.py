"""Training a LightningModule inside ringtrain's own loop (no ``lightning.Trainer``).

Why not the Trainer: the ring is already formed by ``ringcore.init()`` and gradients
go through our ``DistributedOptimizer`` (overlapping backward, fusion), the data
comes from our sharded reader with the same step count on every rank, and the
checkpoints follow the Store layout that ``run_id`` resumes from. Lightning's Trainer
would bring its own process group, sampler and checkpointing. So each worker calls the
module's own methods:

- ``configure_optimizers()`` → one optimizer (alone, in a list, ``([opt], [sched])``
  or ``{"optimizer": opt, "lr_scheduler": sched | {"scheduler": sched, "interval":
  "epoch" | "step"}}``), wrapped in ``DistributedOptimizer``; a scheduler steps per
  epoch (or per step with ``interval="step"``). Several optimizers (manual
  optimization) are refused with a clear error;
- ``training_step(batch, batch_idx)`` → the loss (a tensor or ``{"loss": tensor}``);
  ``batch`` is a dict ``{column: tensor}`` of the feature columns (float32), the label
  columns and the sample weight column (as stored);
- ``validation_step(batch, batch_idx)``, when overridden, on the validation shard;
  a returned tensor (or ``{"loss": ...}``) becomes ``val_loss``;
- the hooks ``on_train_start``, ``on_train_epoch_start``, ``on_train_epoch_end``,
  ``on_validation_epoch_start``, ``on_validation_epoch_end``, ``on_train_end``.

``self.log(name, value)`` / ``self.log_dict`` are recorded (no Trainer to send them to):
their per-row means over every rank enter the history as ``train_<name>`` (or
``val_<name>`` during validation; a name already starting with ``train_`` / ``val_``
keeps it).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

__all__ = [
    "LogRecorder",
    "attach_recorder",
    "call_hook",
    "lightning_optimizer",
    "overrides",
    "step_loss",
]


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


def attach_recorder(module: Any) -> LogRecorder:
    recorder = LogRecorder()
    module.log = recorder.log  # instance attributes shadow the methods
    module.log_dict = recorder.log_dict
    return recorder


def _one(value: Any, what: str) -> Any:
    if isinstance(value, (list, tuple)):
        if len(value) != 1:
            raise ValueError(
                f"configure_optimizers() returned {len(value)} {what}s; ringtrain trains with "
                "one optimizer (and at most one scheduler). Return one, or train a plain "
                "torch.nn.Module with the optimizer param."
            )
        return value[0]
    return value


def lightning_optimizer(module: Any) -> tuple[torch.optim.Optimizer, Any, str]:
    """``(optimizer, scheduler or None, "epoch" | "step")`` from ``configure_optimizers()``."""
    result = module.configure_optimizers()
    scheduler: Any = None
    if isinstance(result, dict):
        optimizer, scheduler = result.get("optimizer"), result.get("lr_scheduler")
    elif (
        isinstance(result, (list, tuple))
        and len(result) == 2
        and all(isinstance(r, (list, tuple)) for r in result)
    ):
        optimizer, scheduler = _one(result[0], "optimizer"), _one(result[1], "scheduler")
        if scheduler is not None and not result[1]:
            scheduler = None
    else:
        optimizer = _one(result, "optimizer")
    interval = "epoch"
    if isinstance(scheduler, dict):
        interval = scheduler.get("interval", "epoch")
        scheduler = scheduler.get("scheduler")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"configure_optimizers() of {type(module).__name__} gave "
            f"{type(optimizer).__name__}, not a torch.optim.Optimizer; return one optimizer "
            "(optionally with a scheduler)."
        )
    if interval not in ("epoch", "step"):
        raise ValueError(f"lr_scheduler interval must be 'epoch' or 'step', got {interval!r}")
    return optimizer, scheduler, interval


def step_loss(result: Any, method: str) -> torch.Tensor | None:
    """The loss in what ``training_step`` / ``validation_step`` returned."""
    if isinstance(result, dict):
        result = result.get("loss")
    if result is None or isinstance(result, torch.Tensor):
        return result
    raise ValueError(
        f"{method} returned {type(result).__name__}; return the loss tensor or {{'loss': tensor}}."
    )


def overrides(module: Any, method: str) -> bool:
    """Whether ``module``'s class defines ``method`` over ``LightningModule``'s own."""
    base = next(c for c in type(module).__mro__ if c.__name__ == "LightningModule")
    return getattr(type(module), method, None) is not getattr(base, method, None)


def call_hook(module: Any, name: str) -> None:
    hook = getattr(module, name, None)
    if callable(hook):
        hook()
