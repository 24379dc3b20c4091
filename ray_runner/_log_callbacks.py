"""The driver's side of ``ray_runner.ray_logger``: the callables that
``RayExecutor.run(fn, callbacks=[...])`` takes, and every value the ranks log handed to
them while ``fn`` runs (as Horovod's ``RayExecutor``).

Each rank queues what it logs in its own process (``ray_runner._logger``); the driver
drains the queues of all ranks (``RingWorker.drain_logs``) every poll interval and once
more at the end, also when a rank failed. With no callbacks the queues are still drained
once at the end, so nothing logged reaches the callbacks of a later call.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import ray

from ringcore import WorkerError
from ringcore.launch import get_float

from . import _constants as const
from ._envelopes import collect

log = logging.getLogger("ringtrain.ray_runner")

__all__ = ["check_callbacks", "collect_logging"]


def check_callbacks(callbacks: Any) -> list[Callable[[Any], Any]]:
    """``callbacks``: None or a list of callables (functions or objects with ``__call__``)."""
    if callbacks is None:
        return []
    if callable(callbacks) or not isinstance(callbacks, (list, tuple)):
        raise TypeError(
            f"callbacks takes a list of callables, got {type(callbacks).__name__}; "
            "wrap a single one: callbacks=[fn]"
        )
    for cb in callbacks:
        if not callable(cb):
            raise TypeError(
                f"callbacks[{list(callbacks).index(cb)}] is a {type(cb).__name__}, not a "
                "callable; pass functions or objects with __call__(value)"
            )
    return list(callbacks)


def collect_logging(
    refs: list, workers: list, hosts: list[str], callbacks: list[Callable[[Any], Any]]
) -> list:
    """Collect ``refs`` (one per rank, see ``_envelopes.collect``); meanwhile hand every
    value the ranks log to ``callbacks``."""

    def deliver() -> None:
        try:
            batches = ray.get([w.drain_logs.remote() for w in workers])
        except ray.exceptions.RayError as exc:  # a dead rank: its run call says so
            log.debug("could not collect the logged values: %s", exc)
            return
        for values in batches:
            for value in values:
                for callback in callbacks:
                    callback(value)

    if not callbacks:
        try:
            return collect(refs, hosts)
        finally:  # nothing logged reaches the callbacks of a later call
            with contextlib.suppress(ray.exceptions.RayError):
                ray.get(
                    [w.drain_logs.remote() for w in workers],
                    timeout=get_float(const.PING_TIMEOUT_ENV_VAR, const.DEFAULT_PING_TIMEOUT_S),
                )
    poll_s = get_float(const.REPORT_POLL_INTERVAL_ENV_VAR, const.DEFAULT_REPORT_POLL_INTERVAL_S)
    try:
        return collect(refs, hosts, deliver, poll_s)
    except WorkerError:
        deliver()  # what the ranks logged before one failed counts too
        raise
