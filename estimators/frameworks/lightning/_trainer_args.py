"""The Lightning-only params, and the ``trainer_args`` ringtrain sets itself.

**The Lightning-only params** (:data:`LIGHTNING_PARAMS`: ``trainer_args``, ``logger``,
``log_every_n_steps``, ``terminate_on_nan``, ``profiler``, each with the value that
means unset) configure the ``lightning.Trainer`` every worker fits a LightningModule
under. ``trainer_args`` must not set what ringtrain sets itself
(:data:`RESERVED_TRAINER_ARGS`), and its ``strategy`` is one of
:data:`LIGHTNING_STRATEGIES` (Lightning's ``DDPStrategy`` on the job's process group;
``_strategies``) or absent (ringtrain's ``RingStrategy``): the params table's converter
refuses such a key or name as it is set (:func:`to_trainer_args`), the driver checks
the rest against the Trainer's signature before any job (:func:`check_trainer_args`).
Lightning itself is not imported.
"""

from __future__ import annotations

import inspect
from typing import Any

__all__ = [
    "FSDP_NOT_OFFERED",
    "LIGHTNING_PARAMS",
    "LIGHTNING_STRATEGIES",
    "RESERVED_TRAINER_ARGS",
    "check_reserved_trainer_args",
    "check_strategy",
    "check_trainer_args",
    "to_trainer_args",
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
    "devices": "every rank trains on one device (under strategy 'ddp', devices is the ranks on each host); size the job with num_proc",
    "num_nodes": "the ranks are the Spark tasks (under strategy 'ddp', num_nodes is their hosts); size the job with num_proc",
    "accelerator": "use use_gpu=True / False",
    "max_epochs": "use epochs",
    "enable_checkpointing": "ringtrain checkpoints into the store every epoch and resumes a run_id from there; a ModelCheckpoint in callbacks still writes its own files",
    "callbacks": "use the callbacks param",
    "logger": "use the logger param",
    "log_every_n_steps": "use the log_every_n_steps param",
    "profiler": "use the profiler param",
}


# trainer_args["strategy"] names accepted: Lightning's DDPStrategy started by the
# launcher (its "popen" start), as Lightning's registry builds them
LIGHTNING_STRATEGIES = (
    "ddp",
    "ddp_find_unused_parameters_true",
    "ddp_find_unused_parameters_false",
)

FSDP_NOT_OFFERED = (
    "Lightning 2.6's FSDPStrategy (FSDP1) runs on CUDA only (its accelerator connector "
    "refuses accelerator='cpu'), so it cannot run on CPU ranks over Gloo, where ringtrain "
    "tests what it offers. For FSDP2 (parameters, gradients and optimizer state "
    "sharded over the ranks), train the module's network as a torch.nn.Module with "
    "RingEstimator(strategy='fsdp'); or drop 'strategy' for ringtrain's RingStrategy, or "
    "use trainer_args={'strategy': 'ddp'}"
)


def _accepted() -> str:
    return ", ".join(map(repr, LIGHTNING_STRATEGIES))


def check_strategy(value: Any) -> None:
    """Raise ValueError for a ``trainer_args["strategy"]`` string ringtrain does not run
    (a strategy object is checked by :func:`check_strategy_object`)."""
    if not isinstance(value, str):
        return
    if value in LIGHTNING_STRATEGIES:
        return
    if value.startswith("fsdp"):
        raise ValueError(
            f"trainer_args sets strategy={value!r}, which is not offered: {FSDP_NOT_OFFERED}."
        )
    raise ValueError(
        f"trainer_args sets strategy={value!r}, which ringtrain does not run; the accepted "
        f"ones are {_accepted()} (Lightning's DDPStrategy on the job's process group: the "
        "Spark tasks are its processes, so a strategy that starts processes itself, such "
        "as ddp_spawn, has none to start), or none for ringtrain's RingStrategy."
    )


def check_reserved_trainer_args(trainer_args: dict[str, Any]) -> None:
    """Raise ValueError for a key of ``trainer_args`` that ringtrain sets itself, and
    for a ``strategy`` name it does not run."""
    check_strategy(trainer_args.get("strategy"))
    for key in trainer_args:
        if key in RESERVED_TRAINER_ARGS:
            raise ValueError(
                f"trainer_args sets {key}={trainer_args[key]!r}, which RingEstimator sets "
                f"itself: {RESERVED_TRAINER_ARGS[key]}. Drop {key!r} from trainer_args."
            )


def to_trainer_args(value: Any) -> dict[str, Any]:
    """The params table's converter: a dict of ``lightning.Trainer`` keyword arguments,
    none of those ringtrain sets."""
    if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
        raise TypeError(
            f"trainer_args takes a dict of lightning.Trainer keyword arguments, got {value!r}"
        )
    check_reserved_trainer_args(value)
    return dict(value)


def check_trainer_args(
    trainer_args: dict[str, Any], backward_passes_per_step: int, trainer_cls: Any = None
) -> None:
    """Raise ValueError for a reserved key, for a key ``trainer_cls.__init__`` does not
    take (when given), and for ``accumulate_grad_batches`` against another
    ``backward_passes_per_step``."""
    check_reserved_trainer_args(trainer_args)
    if trainer_cls is not None:
        accepted = set(inspect.signature(trainer_cls.__init__).parameters) - {"self"}
        unknown = sorted(set(trainer_args) - accepted)
        if unknown:
            raise ValueError(
                f"trainer_args has {', '.join(map(repr, unknown))}, which "
                f"{trainer_cls.__module__.split('.trainer')[0]}.Trainer does not take; pass "
                "its keyword arguments only (e.g. precision, gradient_clip_val)."
            )
    accumulate = trainer_args.get("accumulate_grad_batches")
    if accumulate is not None and backward_passes_per_step not in (1, accumulate):
        raise ValueError(
            f"trainer_args sets accumulate_grad_batches={accumulate!r} and "
            f"backward_passes_per_step={backward_passes_per_step}; both set the backward "
            "passes per optimizer step. Pass one of them."
        )
