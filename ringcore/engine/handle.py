"""Handles: what an op submitted to the engine returns (a caller waits on one through
the running engine: ``ringcore.runtime.state.wait_handle``)."""

from __future__ import annotations

import _thread
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["Done", "Handle", "InputHandle", "dtype_name"]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the protocol names it: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


class Done:
    """A one-shot event (``threading.Event``'s ``is_set``/``set``/``wait``) made of one raw
    lock: a handle is made for every op, and an ``Event`` (a condition, a lock and a
    waiters' list) costs several times more to make, set and wait on."""

    __slots__ = ("_flag", "_lock")

    def __init__(self) -> None:
        self._flag = False
        self._lock = _thread.allocate_lock()
        self._lock.acquire()  # held until set(): waiters block on it

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        if not self._flag:
            self._flag = True
            try:  # noqa: SIM105  (once per op: contextlib.suppress costs more)
                self._lock.release()
            except RuntimeError:  # a concurrent set() released it first
                pass

    def wait(self, timeout: float | None = None) -> bool:
        if self._flag:
            return True
        if not self._lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            return self._flag
        self._lock.release()  # let every other waiter through too
        return True


@dataclass
class Handle:
    """What ``*_async`` returns: poll it, or ``synchronize`` it for the result."""

    name: str
    kind: str
    done: Done = field(default_factory=Done)
    result: Any = None
    error: BaseException | None = None
    # execution state
    tensor: torch.Tensor | None = None  # the buffer the collective runs on (output)
    finish: Any = None  # callable(result) -> user result
    into: torch.Tensor | None = None  # in place: the result lands in this (the caller's) tensor
    submitted: float = field(default_factory=time.perf_counter)
    sig: tuple | None = None  # the request's signature, for the response cache
    req: Any = None  # the request as submitted (the fast lane reads its fields)
    event: Any = None  # CUDA: ready on the submitting stream after this event (see cuda_streams)
    held: bool = False  # its submitter waits for it next (a gradient): see submit.HOLD_MAX_S

    def output(self, value: Any) -> Any:
        """What the caller gets for the backend's ``value``: written into ``into`` (copied
        only where the backend worked on another buffer, e.g. bool carried as uint8), or
        ``finish(value)``. ``into`` is a field, not a closure made per op: a closure is
        three more objects per op for the garbage collector to track."""
        t = self.into
        if t is not None:
            if value is t or value.data_ptr() == t.data_ptr():
                return t
            return t.copy_(value)
        return self.finish(value) if self.finish else value

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class InputHandle(Handle):
    """A handle whose ``tensor`` is the caller's input, to be left as it is: the op's
    result is a new tensor, copied by the engine thread (Horovod reads the input when
    the op runs, too). A caller that copied it first would hand the GIL to the engine's
    threads on every op of a burst of async ops (every torch call releases it), and
    wait for it back each time."""
