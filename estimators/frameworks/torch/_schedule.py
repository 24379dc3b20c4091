"""The torch loop's schedule on the workers: the lr_scheduler and the best epoch.

:func:`scheduler_payload` / :func:`build_scheduler` carry an ``lr_scheduler`` to the
workers and rebind it to their optimizer; :func:`best_and_wait` reads, from the
history alone (so a resumed run decides as an uninterrupted one), the best epoch of
the monitored metric and the epochs since. Small functions of plain data.
"""

from __future__ import annotations

import math
from typing import Any

import torch

__all__ = ["best_and_wait", "build_scheduler", "scheduler_payload"]


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
