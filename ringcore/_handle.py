"""Handles: what an op submitted to the engine returns, and how a caller waits on one."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _state

__all__ = ["Handle", "dtype_name", "wait_handle"]


def dtype_name(dtype: torch.dtype) -> str:
    """A dtype as the protocol names it: ``torch.float32`` -> ``"float32"``."""
    return str(dtype).replace("torch.", "")


@dataclass
class Handle:
    """What ``*_async`` returns: poll it, or ``synchronize`` it for the result."""

    name: str
    kind: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    # execution state
    tensor: torch.Tensor | None = None  # the buffer the collective runs on (output)
    finish: Any = None  # callable(result) -> user result
    submitted: float = field(default_factory=time.perf_counter)
    sig: tuple | None = None  # the request's signature, for the response cache
    event: Any = None  # CUDA: ready on the submitting stream after this event (see _cuda_streams)

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


def wait_handle(handle: Any) -> None:
    """Wait for a handle of the running engine, sending its queued requests first."""
    if handle.done.is_set():
        return
    state = _state.current
    if state is not None and state.engine is not None:
        state.engine.flush()
    handle.done.wait()
