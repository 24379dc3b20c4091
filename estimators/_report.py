"""Per-epoch metrics on the driver's stdout, live while the workers train.

Rank 0 rewrites ``<store>/runs/<run_id>/logs/history.json`` (atomically) after every
epoch; :class:`HistoryPrinter` polls that file from one daemon thread and prints
each new epoch once, then prints whatever is left when ``fit`` gets the history
back. Worker output itself may not reach the driver's stdout (local mode), the
Store always does.
"""

from __future__ import annotations

import json
import sys
import threading
from typing import Any, TextIO

from ._store import Store

__all__ = ["HistoryPrinter", "format_epoch"]

_POLL_S = 0.5


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


class HistoryPrinter:
    """Context manager printing each epoch of a run exactly once."""

    def __init__(
        self, store: Store, run_id: str, epochs: int, enabled: bool, out: TextIO | None = None
    ):
        self._store = store
        self._path = store.get_history_path(run_id)
        self._epochs = epochs
        self._enabled = enabled
        self._out = out or sys.stdout
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._printed = len(self._read())  # epochs of an earlier fit of this run_id
        self._thread: threading.Thread | None = None

    def _read(self) -> list[dict[str, Any]]:
        try:
            return list(self._store.read_json(self._path))
        except (FileNotFoundError, json.JSONDecodeError):
            return []

    def _print_new(self, history: list[dict[str, Any]]) -> None:
        with self._lock:
            for entry in history[self._printed :]:
                print(format_epoch(entry, self._epochs), file=self._out, flush=True)
            self._printed = max(self._printed, len(history))

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            self._print_new(self._read())

    def __enter__(self) -> HistoryPrinter:
        if self._enabled:
            self._thread = threading.Thread(
                target=self._poll, name="ringtrain-history", daemon=True
            )
            self._thread.start()
        return self

    def finish(self, history: list[dict[str, Any]]) -> None:
        """Stop polling and print the epochs of ``history`` not printed yet."""
        self._close()
        if self._enabled:
            self._print_new(history)

    def _close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def __exit__(self, *exc: object) -> None:
        self._close()
