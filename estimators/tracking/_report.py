"""A fit's metrics on the driver, live while the workers train.

Rank 0 rewrites ``<store>/runs/<run_id>/logs/history.json`` (atomically) after every
epoch, and ``progress.json`` beside it a few times a second (``_progress``).
:class:`HistoryPrinter` polls both from one daemon thread every :data:`_POLL_S`: each
new epoch is printed once (``verbose >= 1``) and handed to ``on_epoch`` (MLflow's live
logging), and the latest progress goes to a :class:`~._progress.ProgressDisplay` (a
bar, or plain lines) when ``progress`` is on. When ``fit`` gets the history back, what
is left is printed and handed on. Worker output itself may not reach the driver's
stdout (local mode), the Store always does.
"""

from __future__ import annotations

import json
import sys
import threading
from collections.abc import Callable
from typing import Any, TextIO

from ringcore.progress import ProgressDisplay

from ..store._store import Store
from ._progress import progress_path

__all__ = ["HistoryPrinter", "format_epoch"]

#: how often the driver reads the history and progress files (a few updates a second)
_POLL_S = 0.3


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
    """Context manager printing each epoch of a run exactly once (``enabled``), showing
    rank 0's progress (``progress``) and calling ``on_epoch(entry)`` for each new epoch."""

    def __init__(
        self,
        store: Store,
        run_id: str,
        epochs: int,
        enabled: bool,
        out: TextIO | None = None,
        progress: bool = False,
        on_epoch: Callable[[dict[str, Any]], None] | None = None,
    ):
        self._store = store
        self._path = store.get_history_path(run_id)
        self._progress_path = progress_path(store, run_id)
        self._epochs = epochs
        self._enabled = enabled
        self._out = out or sys.stdout
        self._on_epoch = on_epoch
        self._lock = threading.Lock()
        self._stop = threading.Event()
        earlier = list(self._read(self._path))  # epochs of an earlier fit of this run_id
        self._printed = len(earlier)
        self._last_epoch = int(earlier[-1].get("epoch", 0)) if earlier else 0
        self._seen_progress = self._read(self._progress_path, None)  # an earlier fit's
        self.display = ProgressDisplay(self._out) if progress else None
        self._thread: threading.Thread | None = None

    def _read(self, path: str, empty: Any = ()) -> Any:
        try:
            return self._store.read_json(path)
        except (OSError, json.JSONDecodeError):
            return list(empty) if isinstance(empty, tuple) else empty

    def _print_new(self, history: list[dict[str, Any]]) -> None:
        with self._lock:
            for entry in history[self._printed :]:
                if self._enabled:
                    line = format_epoch(entry, self._epochs)
                    if self.display is not None:
                        self.display.write(line)
                    else:
                        print(line, file=self._out, flush=True)
                if self._on_epoch is not None:
                    self._on_epoch(entry)
                self._last_epoch = int(entry.get("epoch", self._last_epoch))
            self._printed = max(self._printed, len(history))

    def _show_progress(self, progress: Any) -> None:
        if isinstance(progress, dict) and progress != self._seen_progress:
            self._seen_progress = None  # from now on every change is this fit's
            with self._lock:
                if self.display is not None:
                    self.display.update(progress)

    def _emit(self, progress: Any, history: list[dict[str, Any]], final: bool = False) -> None:
        """The epoch lines of ``history`` not printed yet and rank 0's ``progress``, in
        the order they happened: the epochs before the progress's own, the progress,
        then the rest. A plain progress line whose epoch's line is out already (read
        before rank 0 wrote that epoch's history) is stale and not shown; ``final``:
        the progress gets its plain line now (the last step)."""
        epoch = progress.get("epoch") if isinstance(progress, dict) else None
        if self.display is None or not isinstance(epoch, int):
            self._print_new(history)
            if self.display is not None:
                self._show_progress(progress)
            return
        self._print_new([e for e in history if e.get("epoch", 0) < epoch])
        if epoch > self._last_epoch or self.display.kind != "plain":
            self._show_progress(progress)
            if final:
                self.display.flush()
        self._print_new(history)

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):
            # progress read before the history: rank 0 writes a step's progress before
            # the history of its epoch's end, so what is read is in order (_emit)
            progress = self._read(self._progress_path, None) if self.display else None
            self._emit(progress, list(self._read(self._path)))

    def __enter__(self) -> HistoryPrinter:
        if self.display is not None:
            self.display.open()
        if self._enabled or self.display is not None or self._on_epoch is not None:
            self._thread = threading.Thread(
                target=self._poll, name="ringtrain-history", daemon=True
            )
            self._thread.start()
        return self

    def finish(self, history: list[dict[str, Any]]) -> None:
        """Stop polling, then print (and hand on) the epochs of ``history`` not seen yet
        and rank 0's last progress, in order; every line is out when this returns."""
        self._stop_polling()
        progress = self._read(self._progress_path, None) if self.display else None
        self._emit(progress, history, final=True)  # the last step, after the poller's look
        self._close()

    def _stop_polling(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _close(self) -> None:
        self._stop_polling()
        if self.display is not None:
            self.display.close()

    def __exit__(self, *exc: object) -> None:
        self._close()
