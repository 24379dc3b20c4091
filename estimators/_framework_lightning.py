"""LightningModules: the :class:`~estimators._frameworks.Framework` for ``"lightning"``.

A LightningModule brings its own loss (``training_step``), optimizer
(``configure_optimizers``) and metrics (``self.log``), so the ``optimizer``, ``loss``
and ``metrics`` params stay unset; ringtrain's torch loop trains it (``_lightning.py``
says why not a ``lightning.Trainer``). There is no loss to try on a first batch, so the
model itself runs once on the driver, on all-zero rows of the prepared features' shapes,
before the workers start. Checkpoints, ``transform`` and ``save`` / ``load`` are the
torch ones (:class:`~estimators._framework_torch.TorchFramework`). Lightning itself is
never imported here: a LightningModule exists only once the user imported it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ._framework_torch import TorchFramework, train_spec
from ._frameworks import LIGHTNING
from ._lightning import overrides
from ._metrics import resolve_metrics
from ._train_torch import as_outputs, train

__all__ = ["FRAMEWORK", "LightningFramework", "probe_torch_model"]


@dataclass(frozen=True)
class LightningFramework(TorchFramework):
    """The LightningModule framework (see the module docstring)."""

    name: str = LIGHTNING

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        _check_lightning(model, optimizer, loss)
        resolve_metrics(metrics)
        if metrics:
            raise ValueError(
                "metrics is set, but a LightningModule computes its own: log them with "
                "self.log(name, value) in training_step / validation_step (they enter the "
                "history); unset metrics."
            )

    def check_first_batch(self, cfg: Any, batch: dict[str, Any]) -> None:
        """Nothing on the driver: ``training_step`` runs on the workers."""

    def check_prepared(self, cfg: Any, data: Any) -> None:
        probe_torch_model(cfg.model, data.feature_shapes, len(cfg.label_cols))

    def worker(self, cfg: Any, data: Any) -> tuple[Any, tuple]:
        return train, (train_spec(cfg, data, lightning=True),)


def _check_lightning(model: Any, optimizer: Any, loss: Any) -> None:
    """A LightningModule brings its loss (``training_step``) and its optimizer
    (``configure_optimizers``); the ``optimizer`` and ``loss`` params must stay unset."""
    for name, value, setter in (
        ("optimizer", optimizer, "setOptimizer"),
        ("loss", loss, "setLoss"),
    ):
        if value is not None:
            raise ValueError(
                f"{name} is set, but a LightningModule ({type(model).__name__}) defines its own "
                f"({'configure_optimizers' if name == 'optimizer' else 'training_step'}); "
                f"unset it (drop {setter}) or pass a plain torch.nn.Module."
            )
    if not overrides(model, "training_step"):
        raise ValueError(
            f"the LightningModule {type(model).__name__} does not override training_step; "
            "define training_step(self, batch, batch_idx) returning the loss."
        )


def probe_torch_model(model: torch.nn.Module, shapes: list[list[int]], outputs: int) -> None:
    """Run the model once on the driver, on two all-zero rows of the features' shapes,
    so that a model that does not fit the data fails here with the shapes named, not
    as a traceback from inside the Spark tasks."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            result = model(*[torch.zeros(2, *shape) for shape in shapes])
        as_outputs(result, outputs)
    except Exception as exc:
        raise ValueError(
            f"the model fails on a batch of the feature columns' shapes "
            f"{[[2, *s] for s in shapes]} (float32; rows first): {type(exc).__name__}: {exc}. "
            "Make its input layer match the features, or fix feature_cols."
        ) from exc
    finally:
        model.train(was_training)


FRAMEWORK = LightningFramework()
