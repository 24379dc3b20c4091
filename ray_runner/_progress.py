"""RingTrainer's live progress on the driver, from rank 0's reports.

Each report of rank 0 that reaches the driver is one step of the run (Ray's
``training_iteration``): the display shows the step, the report's ``loss`` when it
has one, its other numbers, and the reports per second since the first one
(``steps/s``). It is ringcore.progress's display, shared with spark_runner and the
estimators: a tqdm bar in a terminal, the notebook widget in Jupyter, plain lines
otherwise; the display is updated at most every :data:`UPDATE_INTERVAL_S` (and once
more at the end, so the last report always shows). With the display on, the
per-report lines of ``verbose=1`` go through it (a terminal bar stays whole).

On with ``RunConfig(verbose=1)`` (the default) unless ``RunConfig(progress=False)``
or ``RING_PROGRESS=0``. It is a driver-side :class:`Callback` the trainer adds after
the user's callbacks. (The estimators show rank 0's progress file on the same display:
``ringcore.runs.RunWatcher``; both pick a report's numbers with ``ringcore.runs.numeric``.)
"""

from __future__ import annotations

import time
from typing import Any, TextIO

from ringcore.progress import ProgressDisplay, progress_enabled
from ringcore.runs import numeric

from ._callbacks import Callback

__all__ = ["UPDATE_INTERVAL_S", "ProgressCallback", "progress_callback"]

#: the driver updates the display at most this often (and once more at the end)
UPDATE_INTERVAL_S = 0.3

# keys of the display's own; a report's metric of that name is not shown as a metric
_RESERVED = ("epoch", "epochs", "step", "steps", "total", "rows_per_s", "steps_per_s")


class ProgressCallback(Callback):
    """Rank 0's reports on a :class:`ringcore.progress.ProgressDisplay` (driver side)."""

    #: seconds between display updates (a class attribute: a test may change it)
    update_interval_s = UPDATE_INTERVAL_S

    def __init__(self, verbose: int = 1, out: TextIO | None = None, desc: str = "RingTrainer"):
        self.verbose = verbose
        self.display = ProgressDisplay(out, desc=desc)
        self._reports = 0
        self._first: float | None = None
        self._last_update = float("-inf")
        self._latest: dict[str, Any] | None = None
        self._shown: dict[str, Any] | None = None

    def on_start(self, *, name: str, path: str, config: dict | None) -> None:
        self.display.open()

    def on_report(self, metrics: dict, checkpoint: Any) -> None:
        from ._results import Reports

        self._reports += 1
        now = time.monotonic()
        if self._first is None:
            self._first = now
        if self.verbose:
            self.display.write(Reports._line(self._reports, metrics, checkpoint))
        progress: dict[str, Any] = {
            "step": self._reports,
            **numeric(metrics, skip=_RESERVED, nested=False),
        }
        if self._reports > 1 and now > self._first:
            progress["steps_per_s"] = (self._reports - 1) / (now - self._first)
        self._latest = progress
        if now - self._last_update >= self.update_interval_s:
            self._show(now)

    def _show(self, now: float) -> None:
        if self._latest is not None and self._latest is not self._shown:
            self._last_update = now
            self._shown = self._latest
            self.display.update(self._latest)

    def _close(self) -> None:
        self._show(time.monotonic())  # the last report always shows
        self.display.close()

    def on_end(self, result: Any) -> None:
        self._close()

    def on_error(self, error: BaseException) -> None:
        self._close()


def progress_callback(run_config: Any, name: str) -> ProgressCallback | None:
    """The progress display of a run, or None when ``verbose=0``, ``progress=False``
    or ``RING_PROGRESS=0`` turn it off."""
    if not run_config.verbose or not progress_enabled(getattr(run_config, "progress", True)):
        return None
    return ProgressCallback(run_config.verbose, desc=name)
