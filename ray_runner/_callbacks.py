"""Driver-side callbacks of a RingTrainer run: ``RunConfig(callbacks=[...])``.

A :class:`Callback` sees the run from the driver process, never from a worker: the
run starting, each report of rank 0 as it reaches the driver (with the checkpoint
persisted in storage when one was reported), and the run ending with a
:class:`Result` or with the error that ends it. Subclass it and override the hooks
you need; every hook is a no-op by default. A hook that raises ends the run with
that exception (a broken tracker should not train on silently).

Ray Tune's callback hooks map onto these: ``on_trial_result`` -> ``on_report``,
``on_trial_complete`` -> ``on_end``, ``on_trial_error`` -> ``on_error``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._checkpoint import Checkpoint

__all__ = ["Callback"]


class Callback:
    """Base class of RingTrainer's driver-side callbacks; every hook does nothing by default."""

    def on_start(self, *, name: str, path: str, config: dict | None) -> None:
        """The run ``name`` begins in storage folder ``path`` with ``train_loop_config``."""

    def on_report(self, metrics: dict, checkpoint: Checkpoint | None) -> None:
        """Rank 0 reported ``metrics`` (and ``checkpoint``, already persisted in storage)."""

    def on_restart(self, *, error: BaseException, failures: int) -> None:
        """A worker failed with ``error``; the group restarts (``failures`` so far)."""

    def on_end(self, result: Any) -> None:
        """The run finished; ``result`` is the :class:`Result` that ``fit()`` returns."""

    def on_error(self, error: BaseException) -> None:
        """The run ends with ``error`` (no restarts left), just before ``fit()`` raises it."""
