"""CUDA streams around the engine's ops, so gradients travel while backward computes.

A CUDA op records an event on the submitting thread's stream (:func:`mark_ready`);
the engine thread runs the op (fusion copies, scaling, the collective) on one side
stream per device that first waits for that event (:func:`device_scope`), so backward
keeps computing on its own stream; ``synchronize()`` makes the caller's stream wait
for the side stream (:func:`join_streams`: a GPU-side wait, not a host block).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["device_scope", "join_streams", "mark_ready", "side_stream"]

_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def side_stream(device: Any) -> Any:
    """The engine's CUDA stream on ``device`` (one per device, made on first use)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def mark_ready(handle: Any) -> None:
    """At submission: an event on the submitting stream, after which the tensor is ready."""
    t = handle.tensor
    if t is not None and t.is_cuda:
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        handle.event = event


@contextlib.contextmanager
def device_scope(handles: list[Any]) -> Iterator[None]:
    """Run the engine's work for ``handles`` on the side stream, after their events."""
    events = [h.event for h in handles if h is not None and h.event is not None]
    if not events:
        yield
        return
    import torch

    device = next(h.tensor.device for h in handles if h is not None and h.event is not None)
    stream = side_stream(device)
    for event in events:
        stream.wait_event(event)
    with torch.cuda.stream(stream):
        yield


def join_streams(handle: Any) -> None:
    """After a wait: the caller's stream waits for the side stream, so reading the
    result on it is ordered after the collective (no host-side block), and results
    made on the side stream are marked as used by the caller's stream (so the caching
    allocator does not hand their memory to the side stream too early)."""
    parts = getattr(handle, "parts", None)
    if not parts:  # one op's handle (a CPU op has no event): once per synchronize
        if getattr(handle, "event", None) is None:
            return
        parts = [handle]
    elif all(getattr(p, "event", None) is None for p in parts):
        return
    import torch

    device = next(p.tensor.device for p in parts if getattr(p, "event", None) is not None)
    current = torch.cuda.current_stream(device)
    current.wait_stream(side_stream(device))
    for part in parts:
        for t in _tensors(part.result):
            if t.is_cuda:
                t.record_stream(current)


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []
