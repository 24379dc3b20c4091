"""The torch loop's part of a fit's config: its params, checked on the driver.

:data:`TORCH_PARAMS` are the params only the torch loop reads (``loss_weights``,
``precision``, ``lr_scheduler``, early stopping, ...), each with the value that means
unset: set for a LightningModule or a Keras model they are refused before any job,
saying where that framework configures the same thing. :func:`torch_config` reads
them, with ``monitor``, ``monitor_mode`` and ``restore_best_weights`` (which no other
framework refuses), into one frozen :class:`TorchConfig` and checks them: each error
names the param, the value and the fix. The workers apply it (``_loop``, ``_schedule``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

import torch

from ringcore.torch.strategies import FsdpConfig, get_strategy

from ._metrics import resolve_metrics

__all__ = ["TORCH_PARAMS", "TorchConfig", "is_plateau", "monitor_names", "torch_config"]


@dataclass(frozen=True)
class TorchConfig:
    """The torch loop's params of one fit (see the params table for each)."""

    loss_weights: list[float] | None = None
    loss_constructors: list[Any] | None = None
    train_minibatch_fn: Any = None
    strategy: str = "ring"
    fsdp_config: Any = None  # an FsdpConfig once resolved
    gradient_compression: str = "none"
    lr_scheduler: Any = None
    lr_scheduler_interval: str = "epoch"
    precision: str = "32"
    gradient_clip_val: float | None = None
    gradient_clip_algorithm: str = "norm"
    monitor: str = "val_loss"
    monitor_mode: str = "min"
    early_stopping_patience: int | None = None
    early_stopping_min_delta: float = 0.0
    restore_best_weights: bool = True


_DEFAULTS = TorchConfig()
# read by the torch loop, but refused for no model: another framework ignores them
_SHARED = ("monitor", "monitor_mode", "restore_best_weights")
TORCH_PARAMS: Mapping[str, Any] = {
    f.name: getattr(_DEFAULTS, f.name) for f in fields(TorchConfig) if f.name not in _SHARED
}


def is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def _per_label(name: str, values: list[Any] | None, labels: int, setter: str) -> None:
    if values is not None and len(values) not in (1, labels):
        raise ValueError(
            f"{name} has {len(values)} entries but label_cols names {labels}; give one per label "
            f"column (or one for all) with {setter}(...)."
        )


def _check_losses(config: TorchConfig, loss: Any, labels: int) -> None:
    _per_label("loss_weights", config.loss_weights, labels, "setLossWeights")
    for w in config.loss_weights or []:
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"loss_weights holds {w}; each weight must be finite and >= 0.")
    _per_label("loss_constructors", config.loss_constructors, labels, "setLossConstructors")
    if config.loss_constructors and loss is not None:
        raise ValueError(
            "both loss and loss_constructors are set; pass one: loss=fn, or "
            "loss_constructors=[make_loss, ...] (Horovod's: called on every worker)."
        )


def monitor_names(metrics: list[Any], label_cols: list[str]) -> list[str]:
    """The history's metric names: ``train_loss``, ``val_loss``, ``val_<metric>``, ..."""
    many = len(label_cols) > 1
    names = ["loss"] + [
        f"{label}_{name}" if many else name
        for name, _ in resolve_metrics(metrics)
        for label in label_cols
    ]
    return [f"{phase}_{n}" for phase in ("train", "val") for n in names]


def _check_monitor(
    config: TorchConfig, metrics: list[Any], labels: list[str], validation: Any
) -> None:
    if config.monitor_mode not in ("min", "max"):
        raise ValueError(
            f"monitor_mode takes 'min' or 'max', got {config.monitor_mode!r}; set it with "
            "setMonitorMode('max') for a metric where higher is better."
        )
    patience, delta = config.early_stopping_patience, config.early_stopping_min_delta
    if patience is not None and patience < 0:
        raise ValueError(f"early_stopping_patience must be >= 0 (epochs), got {patience}.")
    if delta < 0 or not math.isfinite(delta):
        raise ValueError(f"early_stopping_min_delta must be finite and >= 0, got {delta}.")
    names = monitor_names(metrics, labels)
    watched = patience is not None or is_plateau(config.lr_scheduler)
    if watched and config.monitor not in names:
        raise ValueError(
            f"monitor={config.monitor!r} is not a metric of this fit's history; it has "
            f"{', '.join(names)}. Set one of them with setMonitor(...)."
        )
    if watched and config.monitor.startswith("val_") and validation in (0, 0.0):
        raise ValueError(
            f"monitor={config.monitor!r} needs validation data, but validation=0.0; hold rows "
            "out with setValidation(0.1) (or a column), or monitor 'train_loss'."
        )


def _holds_torch_state(value: Any) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(
        isinstance(v, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)) for v in items
    )


def _check_scheduler(config: TorchConfig, optimizer: Any) -> None:
    if config.lr_scheduler_interval not in ("epoch", "step"):
        raise ValueError(
            f"lr_scheduler_interval takes 'epoch' or 'step', got {config.lr_scheduler_interval!r}."
        )
    sched = config.lr_scheduler
    if sched is None:
        return
    if isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
        if sched.optimizer is not optimizer:
            raise ValueError(
                "lr_scheduler is built on another optimizer than the optimizer param; build it "
                "on that one (StepLR(optimizer, ...)) or pass fn(optimizer) -> scheduler."
            )
        nested = [k for k, v in vars(sched).items() if k != "optimizer" and _holds_torch_state(v)]
        if nested:
            raise ValueError(
                f"lr_scheduler {type(sched).__name__} holds other schedulers or optimizers "
                f"({', '.join(nested)}), which cannot be rebound to the workers' optimizer; pass "
                f"a function instead: lr_scheduler=lambda opt: {type(sched).__name__}(opt, ...)."
            )
        if is_plateau(sched) and config.lr_scheduler_interval == "step":
            raise ValueError(
                "lr_scheduler is a ReduceLROnPlateau, which steps on the monitor metric once per "
                "epoch; set lr_scheduler_interval='epoch'."
            )
    elif not callable(sched):
        raise ValueError(
            f"lr_scheduler takes a torch.optim.lr_scheduler built on the optimizer or "
            f"fn(optimizer) -> scheduler, got {type(sched).__name__}."
        )


def _check_step(config: TorchConfig, use_gpu: bool) -> None:
    if config.precision == "16" and not (use_gpu and torch.cuda.is_available()):
        raise ValueError(
            "precision='16' (float16 autocast with a GradScaler) needs CUDA, but this fit "
            "trains on CPU; use precision='bf16' (bfloat16 autocast works on CPU) or '32', or "
            "train on GPUs (use_gpu=True)."
        )
    clip = config.gradient_clip_val
    if clip is not None and (not math.isfinite(clip) or clip <= 0):
        raise ValueError(f"gradient_clip_val must be a positive number, got {clip}.")
    if config.gradient_clip_algorithm not in ("norm", "value"):
        raise ValueError(
            "gradient_clip_algorithm takes 'norm' or 'value', got "
            f"{config.gradient_clip_algorithm!r}."
        )
    if config.train_minibatch_fn is not None:
        for name in ("gradient_clip_val", "precision"):
            if getattr(config, name) != getattr(_DEFAULTS, name):
                raise ValueError(
                    f"train_minibatch_fn does the batch's forward, backward and optimizer step "
                    f"itself, so {name}={getattr(config, name)!r} would not apply; unset one of "
                    "them (clip or autocast inside train_minibatch_fn)."
                )


_RING_ONLY = {
    "gradient_compression": (
        "compresses the ring's gradient allreduce; ddp and fsdp reduce in torch's own "
        "collectives (fsdp: fsdp_config={'reduce_dtype': 'bfloat16'})"
    ),
    "train_minibatch_fn": (
        "is Horovod's, written against its DistributedOptimizer (synchronize(), "
        "skip_synchronize(), backward passes counted by the optimizer)"
    ),
}


def _check_strategy(config: TorchConfig, cfg: Any) -> TorchConfig:
    """The strategy can train this model with these knobs; fsdp_config resolved."""
    strategy = get_strategy(config.strategy)  # unknown: ValueError naming the known ones
    strategy.check(cfg.model, config.fsdp_config)  # fsdp_config for another strategy, ...
    if config.strategy == "ring":
        return config
    for name, why in _RING_ONLY.items():
        if getattr(config, name) != getattr(_DEFAULTS, name):
            raise ValueError(
                f"{name}={getattr(config, name)!r} needs strategy='ring', but strategy="
                f"{config.strategy!r}: {name} {why}. Unset {name} or use strategy='ring'."
            )
    if not strategy.sharded:
        return config
    if config.precision == "16":
        raise ValueError(
            "precision='16' (float16 autocast with a GradScaler) is not offered with "
            "strategy='fsdp'; use precision='bf16', or fsdp_config={'param_dtype': "
            "'bfloat16'} for FSDP2's own mixed precision."
        )
    if any(cfg.optimizer.state.values()):
        raise ValueError(
            f"the {type(cfg.optimizer).__name__} given has stepped (it holds state), and "
            "strategy='fsdp' rebuilds the optimizer over the sharded parameters, which would "
            "lose it; pass a fresh optimizer (resume from a run's checkpoint with run_id)."
        )
    return replace(config, fsdp_config=FsdpConfig.of(config.fsdp_config))


def torch_config(params: Mapping[str, Any], cfg: Any) -> TorchConfig:
    """The torch loop's params of a fit, checked (see the module docstring)."""
    config = TorchConfig(**{f.name: params[f.name] for f in fields(TorchConfig)})
    labels = list(cfg.label_cols)
    _check_losses(config, cfg.loss, max(1, len(labels)))
    _check_monitor(config, list(cfg.metrics), labels, cfg.validation)
    _check_scheduler(config, cfg.optimizer)
    _check_step(config, cfg.use_gpu)
    return _check_strategy(config, cfg)
