"""The driver's side of a worker's envelope: every :class:`RingWorker` call returns
``("ok", value)`` or ``("error", WorkerError)`` (see ``ray_runner._worker``).

A rank whose actor died, or whose result Ray could not deliver, becomes a
:class:`ringcore.WorkerError` naming that rank and its host, as a failure in the
user's function does, so the driver raises one kind of error for every way a rank fails.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

from ringcore import WorkerError
from ringcore.launch import get_float

from . import _constants as const

__all__ = ["collect", "other_errors", "resolve"]

Envelope = tuple[str, Any]


def resolve(ref: Any, rank: int, hosts: list[str]) -> Envelope:
    """The envelope of ``ref``, the call of rank ``rank`` (``hosts``: each rank's host)."""
    host = hosts[rank] if rank < len(hosts) else "unknown"
    try:
        return ray.get(ref)
    except ray.exceptions.RayActorError as exc:
        return (
            "error",
            WorkerError(rank, host, "ActorDiedError", f"the worker actor died: {exc}"),
        )
    except ray.exceptions.RayError as exc:  # e.g. a result Ray could not serialize
        cause = getattr(exc, "cause", None) or exc
        return ("error", WorkerError(rank, host, type(cause).__name__, str(cause), str(exc)))


def collect(
    refs: list,
    hosts: list[str],
    poll: Callable[[], None] | None = None,
    poll_s: float | None = None,
) -> list:
    """Resolve one envelope per rank (``refs`` in rank order); raise the first failing
    rank's WorkerError at once.

    ``poll`` (when given) runs every ``poll_s`` seconds while ranks are running and
    once more after the last one returned.
    """
    rank_of = {ref: rank for rank, ref in enumerate(refs)}
    results: dict[int, Any] = {}
    pending = list(refs)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=poll_s if poll else None)
        for ref in ready:
            kind, value = resolve(ref, rank_of[ref], hosts)
            if kind == "error":
                raise value
            results[rank_of[ref]] = value
        if poll is not None:
            poll()
    return [results[r] for r in range(len(refs))]


def other_errors(refs: list, hosts: list[str], failed_rank: int) -> list[WorkerError]:
    """The errors of the ranks that fail within a short grace after ``failed_rank``."""
    grace = get_float(const.FAILURE_GRACE_ENV_VAR, const.DEFAULT_FAILURE_GRACE_S)
    others = {ref: rank for rank, ref in enumerate(refs) if rank != failed_rank}
    ready, _ = ray.wait(list(others), num_returns=len(others), timeout=grace)
    errors = []
    for ref in ready:
        kind, value = resolve(ref, others[ref], hosts)
        if kind == "error":
            errors.append(value)
    return errors
