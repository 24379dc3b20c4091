"""The handles of ``ringcore.torch``: what a ``*_async`` op returns (an integer), and
``poll`` / ``synchronize`` on it; a grouped op's handle stands for several ops."""

from __future__ import annotations

import itertools
import threading
from typing import Any

from ..engine.cuda_streams import join_streams
from ..engine.handle import Handle
from ..runtime.state import wait_handle

__all__ = ["discard", "poll", "synchronize", "synchronize_later"]

_handles: dict[int, Any] = {}
_handle_ids = itertools.count(1)
_handles_lock = threading.Lock()


def _register(h: Handle | _Group) -> int:
    with _handles_lock:
        hid = next(_handle_ids)
        _handles[hid] = h
    return hid


def poll(handle: int) -> bool:
    """True when the op behind ``handle`` has finished (synchronize will not block)."""
    with _handles_lock:
        h = _handles.get(handle)
    if h is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    return h.done.is_set()


def synchronize(handle: int) -> Any:
    """Wait for the op behind ``handle`` and return its result (raises its error)."""
    with _handles_lock:
        h = _handles.pop(handle, None)
    if h is None:
        raise ValueError(f"handle {handle!r} is unknown or was already synchronized")
    wait_handle(h)
    if h.error is not None:
        raise h.error
    join_streams(h)  # CUDA: this stream waits for the engine's side stream
    return h.result


def discard(handle: int) -> None:
    """Forget ``handle`` without waiting (after the ring failed); unknown handles are fine."""
    with _handles_lock:
        _handles.pop(handle, None)


def synchronize_later(handle: int) -> Handle:
    with _handles_lock:
        return _handles.pop(handle)


class _Group:
    """A handle over several handles (grouped ops): done when all are; its result is
    the list of theirs, or ``combine`` of that list."""

    def __init__(self, name: str, parts: list[Handle], combine: Any = None):
        self.name, self.parts, self.combine = name, parts, combine
        self.done = _AllEvents(parts)

    @property
    def error(self) -> BaseException | None:
        return next((p.error for p in self.parts if p.error is not None), None)

    @property
    def result(self) -> Any:
        results = [p.result for p in self.parts]
        return self.combine(results) if self.combine else results


class _AllEvents:
    def __init__(self, parts: list[Handle]):
        self.parts = parts

    def is_set(self) -> bool:
        return all(p.done.is_set() for p in self.parts)

    def wait(self, timeout: float | None = None) -> bool:
        return all(p.done.wait(timeout) for p in self.parts)
