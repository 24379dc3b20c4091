"""Callbacks of a torch (or Lightning) fit: the ``callbacks`` param.

A callback is any object with some of these methods (each optional; the base class
:class:`Callback` defines them all as no-ops). They run inside the workers, on every
rank, in the order of the ``callbacks`` list:

- ``set_context(model, optimizer, rank, size)`` before training starts;
- ``on_train_begin(logs)``: ``logs = {"start_epoch": e}`` (> 0 when the run resumed);
- ``on_epoch_begin(epoch, logs)``: ``epoch`` counts from 0;
- ``on_batch_end(batch, logs)``: ``batch`` is the step within the epoch (from 0) and
  ``logs = {"loss": this rank's loss of the batch, "rows": rows of the batch}``;
- ``on_epoch_end(epoch, logs)``: ``logs`` is the epoch's history entry (metrics
  averaged over every rank, the same on every rank). Rank 0 has already written the
  epoch's checkpoint when this runs;
- ``on_train_end(logs)``: ``logs = {"history": [...]}``.

A callback that needs to do something once (write a file, log) checks ``rank == 0``.
Callbacks are cloudpickled to the workers with the model; what they change in the
workers does not come back to the driver's objects.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Callback", "CallbackList"]


class Callback:
    """Base class of a torch callback: override the hooks you need."""

    model: Any = None
    optimizer: Any = None
    rank: int = 0
    size: int = 1

    def set_context(self, model: Any, optimizer: Any, rank: int, size: int) -> None:
        self.model, self.optimizer, self.rank, self.size = model, optimizer, rank, size

    def on_train_begin(self, logs: dict[str, Any]) -> None:
        """Before the first epoch this fit runs."""

    def on_epoch_begin(self, epoch: int, logs: dict[str, Any]) -> None:
        """Before epoch ``epoch`` (from 0)."""

    def on_batch_end(self, batch: int, logs: dict[str, Any]) -> None:
        """After the optimizer saw batch ``batch`` of the epoch."""

    def on_epoch_end(self, epoch: int, logs: dict[str, Any]) -> None:
        """After epoch ``epoch``, with its history entry."""

    def on_train_end(self, logs: dict[str, Any]) -> None:
        """After the last epoch."""


_HOOKS = (
    "set_context",
    "on_train_begin",
    "on_epoch_begin",
    "on_batch_end",
    "on_epoch_end",
    "on_train_end",
)


def check_callbacks(callbacks: list[Any]) -> None:
    """Each callback must define at least one hook (a typo'd method name would be
    silently ignored otherwise)."""
    for cb in callbacks:
        if not any(callable(getattr(cb, hook, None)) for hook in _HOOKS):
            raise ValueError(
                f"callback {cb!r} defines none of {', '.join(_HOOKS)}; subclass "
                "estimators.Callback and override the hooks you need."
            )


class CallbackList:
    """Calls a hook on every callback that has it."""

    def __init__(self, callbacks: list[Any]):
        self.callbacks = list(callbacks)

    def call(self, hook: str, *args: Any) -> None:
        for cb in self.callbacks:
            method = getattr(cb, hook, None)
            if callable(method):
                method(*args)

    def __bool__(self) -> bool:
        return bool(self.callbacks)
