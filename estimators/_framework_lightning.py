"""LightningModules: the :class:`~estimators._frameworks.Framework` for ``"lightning"``.

A LightningModule brings its own loss (``training_step``), optimizer
(``configure_optimizers``) and metrics (``self.log``), so the ``optimizer``, ``loss``
and ``metrics`` params stay unset; every worker fits it under a real
``lightning.Trainer`` with ringtrain's ``RingStrategy`` (``_train_lightning.py``,
``_lightning_strategy.py``), configured by the Lightning-only params
(:data:`LIGHTNING_PARAMS`: ``trainer_args``, ``logger``, ``log_every_n_steps``,
``terminate_on_nan``, ``profiler``). Those are checked before any job
(:func:`lightning_config`, reached through ``_lightning.with_lightning_params``): set on
another framework's model they raise; for a LightningModule the reserved and unknown
``trainer_args``, callbacks that are not the module's Lightning ``Callback`` and objects
that do not pickle raise. There is no loss to try on a first batch, so the model itself
runs once on the driver, on all-zero rows of the prepared features' shapes, before the
workers start. Checkpoints, ``transform`` and ``save`` / ``load`` are the torch ones
(:class:`~estimators._framework_torch.TorchFramework`). Lightning itself is never
imported here: a LightningModule exists only once the user imported it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import cloudpickle
import torch

from ._config import FitConfig
from ._framework_torch import TorchFramework, train_spec
from ._frameworks import LIGHTNING
from ._lightning import LIGHTNING_PARAMS, overrides, refuse_lightning_params
from ._lightning_strategy import lightning_package
from ._metrics import resolve_metrics
from ._train_lightning import LightningTrainSpec, check_trainer_args, train_lightning
from ._train_torch import as_outputs

__all__ = [
    "FRAMEWORK",
    "LIGHTNING_PARAMS",
    "LightningFitConfig",
    "LightningFramework",
    "check_framework_params",
    "lightning_config",
    "lightning_spec",
    "probe_torch_model",
]


def _is_set(value: Any, unset: Any) -> bool:
    return value is not unset and value != unset


def check_framework_params(framework: str, values: dict[str, Any]) -> None:
    """Before any job: a Lightning-only param set for another framework's model raises,
    naming the param, its value and the fix (that framework's loop would ignore it)."""
    if framework != LIGHTNING:
        refuse_lightning_params(framework, values)


@dataclass(frozen=True)
class LightningFitConfig(FitConfig):
    """A LightningModule's ``FitConfig``: the Lightning-only params' values too."""

    trainer_args: dict[str, Any] | None = None
    logger: Any = None
    log_every_n_steps: int = 50
    terminate_on_nan: bool = False
    profiler: Any = None


def _check_lightning_objects(model: Any, values: dict[str, Any], callbacks: list[Any]) -> None:
    package = lightning_package(model)
    for cb in callbacks:
        if not isinstance(cb, package.Callback):
            raise ValueError(
                f"callback {cb!r} is not a {package.__name__}.Callback; a LightningModule's "
                f"callbacks go to its Trainer: subclass {package.__name__}.Callback (hooks "
                "such as on_train_epoch_end(trainer, pl_module)) and pass it with "
                "setCallbacks([...])."
            )
    for name in ("logger", "profiler", "trainer_args"):
        value = values[name]
        if not _is_set(value, LIGHTNING_PARAMS[name]):
            continue
        try:
            cloudpickle.dumps(value)
        except Exception as exc:
            raise ValueError(
                f"{name} ({type(value).__name__}) cannot be pickled, so it cannot be sent to "
                f"the workers: {type(exc).__name__}: {exc}. Pass one that is not started yet "
                f"(e.g. a logger whose experiment is created on first use) with set"
                f"{''.join(p.title() for p in name.split('_'))}(...)."
            ) from exc


def lightning_config(cfg: FitConfig, values: dict[str, Any]) -> FitConfig:
    """``cfg`` with the Lightning-only params' ``values`` (a :class:`LightningFitConfig`)
    for a LightningModule, after checking them; ``cfg`` itself for another model, where
    a Lightning-only param set raises. Runs before any job."""
    check_framework_params(cfg.framework, values)
    if cfg.framework != LIGHTNING:
        return cfg
    trainer_args = dict(values["trainer_args"] or {})
    check_trainer_args(
        trainer_args, cfg.backward_passes_per_step, lightning_package(cfg.model).Trainer
    )
    _check_lightning_objects(cfg.model, values, cfg.callbacks)
    base = {f.name: getattr(cfg, f.name) for f in fields(FitConfig)}
    return LightningFitConfig(**{**base, **values, "trainer_args": trainer_args})


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
        return train_lightning, (lightning_spec(cfg, data),)


def lightning_spec(cfg: Any, data: Any) -> LightningTrainSpec:
    """The torch :class:`TrainSpec` of the fit plus the Trainer's knobs from ``cfg`` (a
    :class:`LightningFitConfig`; a config without a knob gets its default)."""
    base = train_spec(cfg, data, lightning=True)
    knobs = {name: getattr(cfg, name, unset) for name, unset in LIGHTNING_PARAMS.items()}
    knobs["trainer_args"] = dict(knobs["trainer_args"] or {})
    return LightningTrainSpec(**{**vars(base), **knobs})


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
