"""A LightningModule's ``self.log`` into the fit's history.

Every ``self.log`` / ``self.log_dict`` goes on to Lightning's own, and is also recorded
by a :class:`LogRecorder` (weighted sums per name and phase, each batch weighing its
rows); at an epoch's end :func:`logged_means` averages them over every rank, so
``train_<name>`` / ``val_<name>`` enter the history as per-row means, as the torch
loop's metrics do.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import ringcore.torch as hvd

__all__ = ["LogRecorder", "logged_means", "mirror_log", "overrides"]


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


def mirror_log(module: Any, recorder: LogRecorder) -> None:
    """``module.log`` goes on to Lightning's own and also records the value for the
    history (``train_<name>`` / ``val_<name>``, weighted by the batch's rows);
    ``log_dict`` calls ``log``."""
    lightning_log = module.log

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> Any:
        result = lightning_log(name, value, *args, **kwargs)
        trainer = getattr(module, "_trainer", None)
        if trainer is not None and trainer.sanity_checking:
            return result
        scalar = isinstance(value, float | int) or (
            isinstance(value, torch.Tensor) and value.numel() == 1
        )
        if scalar:
            recorder.phase = "val" if trainer is not None and trainer.validating else "train"
            recorder.log(name, value)
        return result

    module.log = log  # an instance attribute shadows the method


def logged_means(recorder: LogRecorder) -> dict[str, float]:
    """The epoch's ``self.log`` values, weighted means over every rank (a name logged on
    some ranks only counts where it was logged)."""
    local = recorder.take()
    names = sorted(set().union(*hvd.allgather_object(sorted(local), name="ringtrain.logged")))
    if not names:
        return {}
    sums = np.stack([local.get(n, np.zeros(2)) for n in names])
    sums = hvd.allreduce(torch.from_numpy(sums), op=hvd.Sum, name="ringtrain.logged_sums")
    return {n: float(s / max(w, 1e-12)) for n, (s, w) in zip(names, sums.tolist(), strict=True)}
