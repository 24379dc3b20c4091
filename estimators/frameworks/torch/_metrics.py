"""Metrics an estimator computes each epoch: built-in names or user callables.

A metric is ``fn(output, label) -> scalar`` giving the batch mean; the training
loop weights it by the batch's rows and averages over every rank.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["BUILTIN_METRICS", "accuracy", "resolve_metrics"]


def accuracy(output: torch.Tensor, label: torch.Tensor) -> torch.Tensor:
    """Share of rows predicted right: argmax of the output for several columns (class
    logits or probabilities), ``output > 0.5`` for one (a probability)."""
    if output.dim() == 2 and output.shape[1] > 1:
        predicted = output.argmax(dim=1)
    else:
        predicted = (output.reshape(-1) > 0.5).to(torch.long)
    return (predicted == label.reshape(-1).to(predicted.dtype)).to(torch.float64).mean()


BUILTIN_METRICS: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {"accuracy": accuracy}


def resolve_metrics(metrics: Sequence[Any]) -> list[tuple[str, Callable[..., Any]]]:
    """``[(name, fn), ...]`` for names of built-in metrics and callables (named by ``__name__``)."""
    resolved = []
    for metric in metrics:
        if isinstance(metric, str):
            if metric not in BUILTIN_METRICS:
                raise ValueError(
                    f"unknown metric {metric!r}; the built-in metrics are "
                    f"{', '.join(sorted(BUILTIN_METRICS))}, or pass a callable fn(output, label)"
                )
            resolved.append((metric, BUILTIN_METRICS[metric]))
        elif callable(metric):
            resolved.append((getattr(metric, "__name__", type(metric).__name__), metric))
        else:
            raise TypeError(f"a metric is a name or a callable fn(output, label); got {metric!r}")
    names = [name for name, _ in resolved]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(
            f"metrics has more than one metric named {', '.join(dupes)}; give each a distinct name"
        )
    return resolved
