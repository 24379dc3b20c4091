"""A fit's metrics on the driver, live while the workers train.

Rank 0 rewrites ``<store>/runs/<run_id>/logs/history.json`` (atomically) after every
epoch, and ``progress.json`` beside it a few times a second (``_progress``). The
run-services layer's :class:`ringcore.runs.RunWatcher` polls both: each new epoch is
printed once as :func:`format_epoch` writes it (``verbose >= 1``) and handed to
``on_epoch`` (MLflow's live logging), and the latest progress goes to the display when
``progress`` is on.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TextIO

from ringcore.runs import RunWatcher

__all__ = ["HistoryPrinter", "format_epoch"]


def format_epoch(entry: dict[str, Any], epochs: int) -> str:
    """``epoch 3/10  train_loss 0.1234  val_accuracy 0.9650  (1.2 s)``."""
    parts = [f"epoch {entry['epoch']}/{epochs}"]
    parts += [
        f"{k} {v:.4f}"
        for k, v in entry.items()
        if k not in ("epoch", "seconds") and isinstance(v, float)
    ]
    if "seconds" in entry:
        parts.append(f"({entry['seconds']:.1f} s)")
    return "  ".join(parts)


class HistoryPrinter(RunWatcher):
    """A fit's :class:`~ringcore.runs.RunWatcher`: each epoch printed as
    :func:`format_epoch` writes it (``enabled``), rank 0's progress shown
    (``progress``), ``on_epoch(entry)`` called for each new epoch."""

    def __init__(
        self,
        store: Any,
        run_id: str,
        epochs: int,
        enabled: bool,
        out: TextIO | None = None,
        progress: bool = False,
        on_epoch: Callable[[dict[str, Any]], None] | None = None,
    ):
        super().__init__(
            store,
            run_id,
            line=(lambda entry: format_epoch(entry, epochs)) if enabled else None,
            out=out,
            progress=progress,
            on_epoch=on_epoch,
        )
