"""LightningModules: the :class:`~estimators.frameworks.Framework` for ``"lightning"``.

A LightningModule brings its own loss (``training_step``), optimizer
(``configure_optimizers``) and metrics (``self.log``), so the ``optimizer``, ``loss``
and ``metrics`` params stay unset; every worker fits it under a real
``lightning.Trainer`` with ringtrain's ``RingStrategy`` (``_train``, ``_strategy``) or,
with ``trainer_args={"strategy": "ddp"}``, Lightning's ``DDPStrategy`` (``_strategies``),
configured by the Lightning-only params (``_trainer_args.LIGHTNING_PARAMS``), which are
refused for another framework's model and checked for a LightningModule before any job
(``_config``). There is no loss to try on a first batch, so the model itself runs once
on the driver, on all-zero rows of the prepared features' shapes, before the workers
start. Checkpoints, ``transform``, ``save`` / ``load`` and MLflow are the torch ones
(:class:`~estimators.frameworks.torch.TorchFramework`). Lightning itself is never
imported here: a LightningModule exists only once the user imported it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import torch

from .._base import Framework
from ..torch._config import TORCH_PARAMS
from ..torch._framework import TorchFramework
from ..torch._metrics import resolve_metrics
from ..torch._tensors import as_outputs
from ._config import lightning_config
from ._log import overrides
from ._train import lightning_spec, train_lightning
from ._trainer_args import LIGHTNING_PARAMS

__all__ = ["LightningFramework", "is_lightning_module", "probe_torch_model"]

# Lightning ships under two names: the unified ``lightning`` package and the older
# standalone ``pytorch_lightning``; their LightningModule classes are distinct.
_LIGHTNING_MODULES = ("lightning.pytorch", "pytorch_lightning")
_ON_ITS_TRAINER = (
    "a LightningModule configures this on its Trainer: trainer_args (precision, "
    "gradient_clip_val, ...), configure_optimizers (schedulers) or Lightning callbacks "
    "(EarlyStopping, ModelCheckpoint)"
)
_CHECKPOINT_CALLBACK = (
    "a LightningModule's fit returns its last epoch; ringtrain checkpoints every epoch "
    "into the store"
)


def is_lightning_module(model: Any) -> bool:
    """Whether ``model`` is a LightningModule of either package (neither is imported)."""
    for name in _LIGHTNING_MODULES:
        module = sys.modules.get(name)
        cls = getattr(module, "LightningModule", None) if module is not None else None
        if cls is not None and isinstance(model, cls):
            return True
    return False


_TRAINER_STRATEGY = (
    "a LightningModule's strategy is its Trainer's: ringtrain's RingStrategy (whole "
    "replicas, gradients averaged by the ring) by default, or Lightning's own DDP on the "
    "job's process group with trainer_args={'strategy': 'ddp'}. Lightning's fsdp runs on "
    "CUDA only; for FSDP2, train the module's network as a torch.nn.Module with "
    "strategy='fsdp'"
)


class LightningFramework(TorchFramework):
    """The LightningModule framework (see the module docstring)."""

    name = "lightning"
    params: Mapping[str, Any] = LIGHTNING_PARAMS

    def refusal(self, name: str, value: Any, model: Framework) -> str:
        return (
            f"{name}={value!r} is set, but the model is a {model.name} model: {name} "
            "configures the lightning.Trainer of a LightningModule, which this model "
            f"is not. Unset it (setParams({name}={self.params[name]!r})) or pass a "
            "lightning.LightningModule as model."
        )

    def instead(self, name: str) -> str | None:
        if name == "checkpoint_callback":
            return _CHECKPOINT_CALLBACK
        if name in ("strategy", "fsdp_config"):
            return _TRAINER_STRATEGY
        return _ON_ITS_TRAINER if name in TORCH_PARAMS else None

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        _check_lightning(model, optimizer, loss)
        resolve_metrics(metrics)
        if metrics:
            raise ValueError(
                "metrics is set, but a LightningModule computes its own: log them with "
                "self.log(name, value) in training_step / validation_step (they enter the "
                "history); unset metrics."
            )

    def resolve(self, params: Mapping[str, Any], cfg: Any) -> Any:
        return lightning_config(params, cfg)

    def check_first_batch(self, cfg: Any, batch: dict[str, Any]) -> None:
        """Nothing on the driver: ``training_step`` runs on the workers."""

    def check_prepared(self, cfg: Any, data: Any) -> None:
        probe_torch_model(cfg.model, data.feature_shapes, len(cfg.label_cols))

    def worker(self, cfg: Any, data: Any) -> tuple[Any, tuple]:
        return train_lightning, (lightning_spec(cfg, data),)


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
