"""The training loop's knobs: checked on the driver, applied by the workers.

:func:`resolve_knobs` reads the knob params of an estimator into one frozen
:class:`TrainingKnobs` and checks them before any job starts (each error names the
param, the value and the fix). Most knobs belong to the torch loop
(``_train_torch``): a LightningModule configures the same things on its Trainer
(``trainer_args``, ``configure_optimizers``, Lightning callbacks) and a Keras model
through Keras callbacks, so a torch knob set for those raises, saying where it goes.

The worker-side pieces live here too, as small functions of plain data:
:func:`scheduler_payload` / :func:`build_scheduler` carry an ``lr_scheduler`` to the
workers and rebind it to their optimizer; :func:`best_and_wait` reads, from the
history alone (so a resumed run decides as an uninterrupted one), the best epoch of
the monitored metric and the epochs since.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from ._frameworks import KERAS, TORCH
from ._metrics import resolve_metrics

__all__ = [
    "TrainingKnobs",
    "best_and_wait",
    "build_scheduler",
    "is_plateau",
    "monitor_names",
    "resolve_knobs",
    "scheduler_payload",
]


@dataclass(frozen=True)
class TrainingKnobs:
    """The knob params of one fit (see the params table for each)."""

    loss_weights: list[float] | None = None
    loss_constructors: list[Any] | None = None
    train_minibatch_fn: Any = None
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
    backend_env: dict[str, str] = field(default_factory=dict)
    custom_objects: dict[str, Any] = field(default_factory=dict)
    tensorflow_dataset_prefetch_buffer_size: int = 1
    checkpoint_callback: Any = None


_DEFAULTS = TrainingKnobs()
_KERAS_ONLY = ("custom_objects", "tensorflow_dataset_prefetch_buffer_size", "checkpoint_callback")
# what a model of another framework uses instead of a Keras-only knob
_KERAS_ONLY_INSTEAD = {
    "checkpoint_callback": {
        TORCH: "a torch model keeps the best epoch by itself: monitor, monitor_mode and "
        "restore_best_weights=True (the default)",
        "lightning": "a LightningModule's fit returns its last epoch; ringtrain checkpoints "
        "every epoch into the store",
    },
}
# which framework's loop reads a knob: the Keras ones, or else the torch loop
_READ_BY = {True: KERAS, False: TORCH}
_ANY = ("backend_env", "restore_best_weights", "monitor", "monitor_mode")
_ELSEWHERE = {
    "lightning": "a LightningModule configures this on its Trainer: trainer_args "
    "(precision, gradient_clip_val, ...), configure_optimizers (schedulers) or Lightning "
    "callbacks (EarlyStopping, ModelCheckpoint)",
    KERAS: "a Keras model configures this with Keras callbacks (LearningRateScheduler, "
    "EarlyStopping) or in model.compile",
}


def _read(est: Any) -> TrainingKnobs:
    values = {name: est.getOrDefault(name) for name in TrainingKnobs.__dataclass_fields__}
    for name in ("gradient_compression", "backend_env", "custom_objects", "lr_scheduler_interval"):
        if values[name] is None:  # Horovod's None: the default
            values[name] = getattr(_DEFAULTS, name)
    return TrainingKnobs(**values)


def _refuse_elsewhere(knobs: TrainingKnobs, framework: str) -> None:
    for name in TrainingKnobs.__dataclass_fields__:
        value = getattr(knobs, name)
        if name in _ANY or value == getattr(_DEFAULTS, name):
            continue
        reader = _READ_BY[name in _KERAS_ONLY]
        if reader is not framework and name in _KERAS_ONLY:
            instead = _KERAS_ONLY_INSTEAD.get(name, {}).get(framework)
            raise ValueError(
                f"{name}={value!r} is set, but it configures a Keras model's fit and the model "
                f"is a {framework} model{': ' + instead if instead else ''}. Unset it "
                f"(setParams({name}={getattr(_DEFAULTS, name)!r}))."
            )
        if reader is not framework:
            raise ValueError(
                f"{name}={value!r} is set, but it configures ringtrain's torch loop and the "
                f"model is a {framework} model: {_ELSEWHERE.get(framework, '')}. Unset it "
                f"(setParams({name}={getattr(_DEFAULTS, name)!r}))."
            )


def _per_label(name: str, values: list[Any] | None, labels: int, setter: str) -> None:
    if values is not None and len(values) not in (1, labels):
        raise ValueError(
            f"{name} has {len(values)} entries but label_cols names {labels}; give one per label "
            f"column (or one for all) with {setter}(...)."
        )


def _check_losses(knobs: TrainingKnobs, loss: Any, labels: int) -> None:
    _per_label("loss_weights", knobs.loss_weights, labels, "setLossWeights")
    for w in knobs.loss_weights or []:
        if not math.isfinite(w) or w < 0:
            raise ValueError(f"loss_weights holds {w}; each weight must be finite and >= 0.")
    _per_label("loss_constructors", knobs.loss_constructors, labels, "setLossConstructors")
    if knobs.loss_constructors and loss is not None:
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
    knobs: TrainingKnobs, metrics: list[Any], labels: list[str], validation: Any
) -> None:
    if knobs.monitor_mode not in ("min", "max"):
        raise ValueError(
            f"monitor_mode takes 'min' or 'max', got {knobs.monitor_mode!r}; set it with "
            "setMonitorMode('max') for a metric where higher is better."
        )
    patience, delta = knobs.early_stopping_patience, knobs.early_stopping_min_delta
    if patience is not None and patience < 0:
        raise ValueError(f"early_stopping_patience must be >= 0 (epochs), got {patience}.")
    if delta < 0 or not math.isfinite(delta):
        raise ValueError(f"early_stopping_min_delta must be finite and >= 0, got {delta}.")
    names = monitor_names(metrics, labels)
    watched = patience is not None or isinstance(
        knobs.lr_scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau
    )
    if watched and knobs.monitor not in names:
        raise ValueError(
            f"monitor={knobs.monitor!r} is not a metric of this fit's history; it has "
            f"{', '.join(names)}. Set one of them with setMonitor(...)."
        )
    if watched and knobs.monitor.startswith("val_") and validation in (0, 0.0):
        raise ValueError(
            f"monitor={knobs.monitor!r} needs validation data, but validation=0.0; hold rows "
            "out with setValidation(0.1) (or a column), or monitor 'train_loss'."
        )


def _check_scheduler(knobs: TrainingKnobs, optimizer: Any) -> None:
    if knobs.lr_scheduler_interval not in ("epoch", "step"):
        raise ValueError(
            f"lr_scheduler_interval takes 'epoch' or 'step', got {knobs.lr_scheduler_interval!r}."
        )
    sched = knobs.lr_scheduler
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
        if is_plateau(sched) and knobs.lr_scheduler_interval == "step":
            raise ValueError(
                "lr_scheduler is a ReduceLROnPlateau, which steps on the monitor metric once per "
                "epoch; set lr_scheduler_interval='epoch'."
            )
    elif not callable(sched):
        raise ValueError(
            f"lr_scheduler takes a torch.optim.lr_scheduler built on the optimizer or "
            f"fn(optimizer) -> scheduler, got {type(sched).__name__}."
        )


def _holds_torch_state(value: Any) -> bool:
    items = value if isinstance(value, (list, tuple)) else [value]
    return any(
        isinstance(v, (torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler)) for v in items
    )


def _check_step(knobs: TrainingKnobs, use_gpu: bool) -> None:
    if knobs.precision == "16" and not (use_gpu and torch.cuda.is_available()):
        raise ValueError(
            "precision='16' (float16 autocast with a GradScaler) needs CUDA, but this fit "
            "trains on CPU; use precision='bf16' (bfloat16 autocast works on CPU) or '32', or "
            "train on GPUs (use_gpu=True)."
        )
    clip = knobs.gradient_clip_val
    if clip is not None and (not math.isfinite(clip) or clip <= 0):
        raise ValueError(f"gradient_clip_val must be a positive number, got {clip}.")
    if knobs.gradient_clip_algorithm not in ("norm", "value"):
        raise ValueError(
            f"gradient_clip_algorithm takes 'norm' or 'value', got {knobs.gradient_clip_algorithm!r}."
        )
    if knobs.train_minibatch_fn is not None:
        for name in ("gradient_clip_val", "precision"):
            if getattr(knobs, name) != getattr(_DEFAULTS, name):
                raise ValueError(
                    f"train_minibatch_fn does the batch's forward, backward and optimizer step "
                    f"itself, so {name}={getattr(knobs, name)!r} would not apply; unset one of "
                    "them (clip or autocast inside train_minibatch_fn)."
                )
    if knobs.tensorflow_dataset_prefetch_buffer_size < 0:
        raise ValueError(
            "tensorflow_dataset_prefetch_buffer_size must be >= 0 (batches; 0: no prefetch), "
            f"got {knobs.tensorflow_dataset_prefetch_buffer_size}."
        )


def resolve_knobs(est: Any, framework: str, use_gpu: bool) -> TrainingKnobs:
    """The estimator's knob params, checked (see the module docstring)."""
    knobs = _read(est)
    _refuse_elsewhere(knobs, framework)
    labels = list(est.getLabelCols() or [])
    _check_losses(knobs, est.getLoss(), max(1, len(labels)))
    if _READ_BY[False] is framework:  # the torch loop's checks
        _check_monitor(knobs, list(est.getMetrics()), labels, est.getValidation())
        _check_scheduler(knobs, est.getOptimizer())
    _check_step(knobs, use_gpu)
    return knobs


# --- worker side -----------------------------------------------------------------------------


def is_plateau(scheduler: Any) -> bool:
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def scheduler_payload(scheduler: Any) -> Any:
    """What travels to the workers: a factory as it is; a scheduler as ``(class, its
    attributes but the optimizer)`` (a scheduler's whole state is its ``__dict__``)."""
    if scheduler is None or not isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler):
        return scheduler
    return (type(scheduler), {k: v for k, v in vars(scheduler).items() if k != "optimizer"})


def _track_steps(optimizer: Any) -> None:
    """What a scheduler's constructor does to its optimizer: mark ``step()`` calls, so
    torch's order check (optimizer before scheduler) holds."""
    step = optimizer.step
    if hasattr(step, "_wrapped_by_lr_sched"):
        return

    def tracked(*args: Any, **kwargs: Any) -> Any:
        optimizer._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    optimizer.step = tracked


def build_scheduler(payload: Any, optimizer: Any) -> Any:
    """The payload's scheduler on this worker's ``optimizer`` (None: no scheduler)."""
    if payload is None:
        return None
    if isinstance(payload, tuple):
        cls, attrs = payload
        scheduler = cls.__new__(cls)
        scheduler.__dict__.update(attrs)
        scheduler.optimizer = optimizer
        _track_steps(optimizer)
        return scheduler
    scheduler = payload(optimizer)
    if not hasattr(scheduler, "step"):
        raise TypeError(
            f"lr_scheduler(optimizer) returned {type(scheduler).__name__}, not a scheduler"
        )
    return scheduler


def _improved(value: float, best: float, mode: str, delta: float) -> bool:
    return value < best - delta if mode == "min" else value > best + delta


def best_and_wait(
    history: list[dict[str, Any]], monitor: str, mode: str, delta: float
) -> tuple[int | None, int]:
    """``(index of the best epoch, epochs since it)`` of ``monitor`` in ``history``
    (None: no epoch has it). An epoch is better only by more than ``delta``."""
    best: float | None = None
    best_index, wait = None, 0
    for index, entry in enumerate(history):
        value = entry.get(monitor)
        if value is None or not math.isfinite(value):
            wait += best_index is not None
            continue
        if best is None or _improved(value, best, mode, delta):
            best, best_index, wait = value, index, 0
        else:
            wait += 1
    return best_index, wait
