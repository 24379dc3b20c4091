"""Training progress on the driver: one display shared by every runner.

A runner hands :class:`ProgressDisplay` the latest progress of rank 0, a plain dict::

    {"step": 40, "total": 100, "loss": 0.31, "steps_per_s": 12.5, ...}
    {"epoch": 2, "epochs": 5, "step": 40, "steps": 100, "loss": 0.31, "rows_per_s": 812}

(``step`` within the epoch when ``epochs`` and ``steps`` are given, else overall, of
``total`` when known; any other number is shown as a metric). The display picks its
form once: the tqdm notebook widget inside a Jupyter kernel (with ipywidgets
installed), a tqdm bar when the output is a terminal, else plain lines, at most one
every :data:`PLAIN_INTERVAL_S` seconds (``flush`` prints the latest one that has no line
yet, so a runner can show the final step). Runners call ``update`` a few times a second
at most. ``RING_PROGRESS=0`` turns every runner's display off
(:func:`progress_enabled`). :func:`say` writes a runner's own lines (a launch, an end).
Importing this module imports neither tqdm nor IPython.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from typing import Any, TextIO

__all__ = [
    "PLAIN_INTERVAL_S",
    "PROGRESS_ENV_VAR",
    "ProgressDisplay",
    "format_progress",
    "in_notebook",
    "progress_enabled",
    "say",
]

PROGRESS_ENV_VAR = "RING_PROGRESS"
#: without a bar (no terminal, no notebook), a progress line at most this often
PLAIN_INTERVAL_S = 5.0


def _logging_configured(logger: logging.Logger) -> bool:
    """Whether a record of ``logger`` reaches a handler someone installed."""
    current: logging.Logger | None = logger
    while current is not None:
        if current.handlers:
            return True
        current = current.parent if current.propagate else None
    return False


def say(logger: logging.Logger, verbose: int, needed: int, msg: str, *args: Any) -> None:
    """A runner's line (its launch, its end): INFO when ``verbose >= needed``, else
    DEBUG. When no handler is configured (no ``logging.basicConfig``), the INFO lines go
    to stderr as ``[ringtrain] ...`` instead of vanishing; with logging configured they
    go through it only (no duplicates)."""
    level = logging.INFO if verbose >= needed else logging.DEBUG
    if level == logging.INFO and not _logging_configured(logger):
        print(f"[ringtrain] {msg % args}", file=sys.stderr, flush=True)
        return
    logger.log(level, msg, *args)


_SHOWN = ("epoch", "epochs", "step", "steps", "total", "loss", "rows_per_s", "steps_per_s")


def progress_enabled(flag: Any = True) -> bool:
    """``flag`` (None counts as on), unless ``RING_PROGRESS`` is 0/false/no/off."""
    value = os.environ.get(PROGRESS_ENV_VAR, "").strip().lower()
    if value in ("0", "false", "no", "off"):
        return False
    if value not in ("", "1", "true", "yes", "on"):
        raise ValueError(
            f"{PROGRESS_ENV_VAR}={value!r} is not a switch; set it to 0 (no progress bar) or 1, "
            "or unset it"
        )
    return flag is None or bool(flag)


def _position(p: dict[str, Any]) -> tuple[int, int | None]:
    """``(steps done overall, total steps or None)``."""
    step = int(p.get("step") or 0)
    if p.get("epochs") and p.get("steps"):
        steps = int(p["steps"])
        return (int(p.get("epoch") or 1) - 1) * steps + step, int(p["epochs"]) * steps
    total = p.get("total")
    return step, (int(total) if total else None)


def _extras(p: dict[str, Any]) -> dict[str, float]:
    return {
        k: float(v)
        for k, v in p.items()
        if k not in _SHOWN and isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def format_progress(p: dict[str, Any]) -> str:
    """``epoch 2/5  step 40/100  loss 0.3127  812 rows/s`` (or ``step 40/100  ...``)."""
    parts = []
    if p.get("epochs"):
        parts.append(f"epoch {p.get('epoch')}/{p['epochs']}")
    of = p.get("steps") if p.get("epochs") else p.get("total")
    parts.append(f"step {p.get('step')}/{of}" if of else f"step {p.get('step')}")
    if p.get("loss") is not None:
        parts.append(f"loss {float(p['loss']):.4f}")
    parts += [f"{k} {v:.4g}" for k, v in _extras(p).items()]
    if p.get("rows_per_s") is not None:
        parts.append(f"{float(p['rows_per_s']):.0f} rows/s")
    if p.get("steps_per_s") is not None:
        parts.append(f"{float(p['steps_per_s']):.2f} steps/s")
    return "  ".join(parts)


def in_notebook() -> bool:
    """Whether this process is a Jupyter kernel (a ZMQ shell, not a terminal IPython)."""
    if "ipykernel" not in sys.modules:
        return False
    try:
        from IPython import get_ipython
    except ImportError:
        return False
    shell = get_ipython()
    return shell is not None and type(shell).__name__ == "ZMQInteractiveShell"


def _kind(out: TextIO) -> str:
    try:
        import tqdm  # noqa: F401
    except ImportError:
        return "plain"
    if out is sys.stdout and in_notebook():
        try:
            import ipywidgets  # noqa: F401
        except ImportError:
            return "plain"
        return "notebook"
    isatty = getattr(out, "isatty", None)
    return "tty" if callable(isatty) and isatty() else "plain"


class ProgressDisplay:
    """Rank 0's progress on the driver: a bar (terminal, notebook) or plain lines."""

    #: seconds between plain lines (a class attribute: a test may lower it)
    plain_interval_s = PLAIN_INTERVAL_S

    def __init__(self, out: TextIO | None = None, kind: str | None = None, desc: str = "fit"):
        self._out = out or sys.stdout
        if kind not in (None, "notebook", "tty", "plain"):
            raise ValueError(f"kind must be None, 'notebook', 'tty' or 'plain', got {kind!r}")
        self.kind = kind or _kind(self._out)
        self._desc = desc
        self._bar: Any = None
        self._last_plain = float("-inf")
        self._last: dict[str, Any] | None = None
        self._last_printed = False  # plain: whether the latest progress has its line
        self.updates = 0  # how many distinct progress values it was given

    def _make_bar(self, total: int | None) -> Any:
        if self.kind == "notebook":
            from tqdm.notebook import tqdm
        else:
            from tqdm import tqdm
        return tqdm(total=total, file=self._out, desc=self._desc, unit="step", dynamic_ncols=True)

    def open(self) -> ProgressDisplay:
        """Show the notebook widget now, from the calling (the cell's) thread: output a
        kernel gets from a poller thread may land in another cell, widget updates do not."""
        if self.kind == "notebook" and self._bar is None:
            self._bar = self._make_bar(None)
        return self

    def update(self, p: dict[str, Any]) -> None:
        if p == self._last:
            return
        self._last = dict(p)
        self.updates += 1
        if self.kind == "plain":
            now = time.monotonic()
            self._last_printed = now - self._last_plain >= self.plain_interval_s
            if self._last_printed:
                self._last_plain = now
                print(format_progress(p), file=self._out, flush=True)
            return
        done, total = _position(p)
        if self._bar is None:
            self._bar = self._make_bar(total)
        elif total and self._bar.total != total:
            self._bar.reset(total=total)
        self._bar.n = min(done, total) if total else done
        postfix: dict[str, str] = {}
        if p.get("epochs"):
            postfix["epoch"] = f"{p.get('epoch')}/{p['epochs']}"
        if p.get("loss") is not None:
            postfix["loss"] = f"{float(p['loss']):.4f}"
        postfix.update({k: f"{v:.4g}" for k, v in _extras(p).items()})
        if p.get("rows_per_s") is not None:
            postfix["rows/s"] = f"{float(p['rows_per_s']):.0f}"
        if p.get("steps_per_s") is not None:
            postfix["steps/s"] = f"{float(p['steps_per_s']):.2f}"
        self._bar.set_postfix(postfix, refresh=False)
        self._bar.refresh()

    def write(self, line: str) -> None:
        """A line (an epoch's, a launch's) that does not break a terminal bar."""
        if self._bar is not None and self.kind == "tty":
            self._bar.write(line, file=self._out)
        else:
            print(line, file=self._out, flush=True)

    def flush(self) -> None:
        """Plain lines: print the latest progress now if it has no line yet (the final
        step, which came within ``plain_interval_s`` of the line before). A bar shows
        every update already."""
        if self.kind == "plain" and self._last is not None and not self._last_printed:
            self._last_printed = True
            print(format_progress(self._last), file=self._out, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
