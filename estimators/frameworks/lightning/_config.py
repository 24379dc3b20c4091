"""A LightningModule's part of a fit's config: the Trainer's params, checked on the driver.

:func:`lightning_config` reads the Lightning-only params
(:data:`~._trainer_args.LIGHTNING_PARAMS`) into a frozen :class:`LightningConfig` and
checks them before any job: ``trainer_args`` against the ``lightning.Trainer`` of the
module's package (no reserved key, no key the Trainer does not take, no
``accumulate_grad_batches`` against another ``backward_passes_per_step``, a ``strategy``
that is absent, ``"ddp"`` or a ``DDPStrategy``: ``_strategies``), callbacks
that are not the package's Lightning ``Callback``, and a logger, profiler or
``trainer_args`` that does not pickle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

from ._strategies import check_strategy_object
from ._strategy import lightning_package
from ._trainer_args import LIGHTNING_PARAMS, check_trainer_args

__all__ = ["LightningConfig", "lightning_config"]


@dataclass(frozen=True)
class LightningConfig:
    """The Lightning-only params of one fit (see the params table for each)."""

    trainer_args: dict[str, Any] = field(default_factory=dict)
    logger: Any = None
    log_every_n_steps: int = 50
    terminate_on_nan: bool = False
    profiler: Any = None


def _is_set(value: Any, unset: Any) -> bool:
    return value is not unset and value != unset


def _setter(name: str) -> str:
    return "set" + "".join(p.title() for p in name.split("_"))


def _check_objects(model: Any, values: Mapping[str, Any], callbacks: list[Any]) -> None:
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
                f"(e.g. a logger whose experiment is created on first use) with "
                f"{_setter(name)}(...)."
            ) from exc


def lightning_config(params: Mapping[str, Any], cfg: Any) -> LightningConfig:
    """The Lightning-only params of a fit of ``cfg.model``, checked (see the module
    docstring); before any job."""
    values = {name: params[name] for name in LIGHTNING_PARAMS}
    trainer_args = dict(values["trainer_args"] or {})
    check_trainer_args(
        trainer_args, cfg.backward_passes_per_step, lightning_package(cfg.model).Trainer
    )
    check_strategy_object(lightning_package(cfg.model), trainer_args.get("strategy"))
    _check_objects(cfg.model, values, cfg.callbacks)
    return LightningConfig(**{**values, "trainer_args": trainer_args})
