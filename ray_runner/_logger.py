"""``ray_runner.ray_logger.log(info)``: values a worker sends to the driver's callbacks.

As Horovod's ``horovod.ray.ray_logger``: inside a function that
``RayExecutor.run(fn, callbacks=[...])`` (or ``ElasticRayExecutor.run``) runs, a worker
calls ``ray_logger.log({"loss": ...})``; the driver calls every callback with every
logged value, in the order each worker logged them. Values are queued in the worker's
process and collected by the driver while the function runs (every 0.2 s,
``RING_REPORT_POLL_INTERVAL``) and once more when it ends. Outside a worker, ``log``
warns once and drops the value, as Horovod's does.
"""

from __future__ import annotations

import queue
import warnings
from typing import Any

__all__ = ["drain", "enable", "log"]

_queue: queue.SimpleQueue = queue.SimpleQueue()
_enabled = False
_warned = False


def enable() -> None:
    """Called by the worker actor: this process is a worker, so ``log`` queues."""
    global _enabled
    _enabled = True


def log(info_dict: Any) -> None:
    """Send ``info_dict`` (any picklable value, usually a dict) to the driver's callbacks."""
    global _warned
    if _enabled:
        _queue.put(info_dict)
    elif not _warned:
        _warned = True
        warnings.warn(
            "ray_logger.log was called outside a RayExecutor worker; the value is dropped. "
            "Call it inside the function that RayExecutor.run(fn, callbacks=[...]) runs.",
            stacklevel=2,
        )


def drain() -> list[Any]:
    """Everything logged in this process since the last call, oldest first."""
    out = []
    while True:
        try:
            out.append(_queue.get_nowait())
        except queue.Empty:
            return out
