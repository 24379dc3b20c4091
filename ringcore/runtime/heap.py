"""The collector's view of the heap while a rank is in a job: frozen at ``init()``,
refreshed now and then, thawed at ``shutdown()``.

A full collection walks every tracked object of the process. With torch imported
that is ~170,000 objects, almost all of them from imports, and one collection holds
the GIL for ~90 ms on this project's test machines. The engine's per-op objects (a
handle, its event, a key) survive the young collections of a burst of async ops, so
about every 10th young-generation pass a full one runs: a 1,000-op burst that takes
20 ms takes ~110 ms, on each rank in turn, and every rank waits for the slowest.

``init()`` therefore collects once and then ``gc.freeze()``s what is alive (the
imports, the job's connections): the collector no longer walks it, so a full
collection costs about what the young ones do. Everything made later (per-step
tensors, a Keras graph built in the job) is tracked and collected as before.

What was alive at ``init()`` and becomes cyclic garbage later (a model built before
``init()``, as scripts and Lightning do, dropped during the job) is out of the
collector's sight while frozen. So the heap is **refreshed** every
``RING_GC_REFRESH_SECONDS`` (unset: 30 s, or 200 times what the last refresh cost
when that is longer, so refreshing takes at most 0.5 % of the time; 0: never): thawed, collected in full and
frozen again, from the engine's sender thread (:func:`refresh_if_due`, called between
its sends and on each second it idles), never inside an op's execution. Garbage the
freeze hid is freed within one period. ``shutdown()`` ``gc.unfreeze()``s what
``init()`` froze, so a process that runs several jobs (a reused Spark Python worker, a
notebook kernel) keeps nothing frozen.

A heap someone else froze is left as it is: at ``init()`` (``gc.get_freeze_count()``
> 0) nothing is frozen, refreshed or thawed; after ``init()`` (an object ringcore made
right after its own freeze is frozen too: looked up among ``gc.get_objects()`` at each
refresh and at ``shutdown()``, which lists only what is not frozen) ringcore stops
refreshing and ``shutdown()`` leaves the heap frozen. ``RING_GC_FREEZE=0`` turns all
of this off. While frozen, ``gc.get_objects()`` does not list the frozen
objects (leak hunts want ``RING_GC_FREEZE=0``).
"""

from __future__ import annotations

import gc
import logging
import math
import threading
import time

from .. import _config as cfg

__all__ = ["freeze_heap", "refresh_if_due", "thaw_heap"]

log = logging.getLogger("ringtrain.ringcore")

#: a refresh takes at most 1/_COST_SHARE of the time between refreshes
_COST_SHARE = 200

_lock = threading.Lock()
_frozen_here = False
_count = 0  # the frozen count right after ringcore's last freeze
_due = math.inf  # time.monotonic() of the next refresh


class _Marker:
    """Made right after each freeze of ringcore's, so tracked and not frozen: a later
    ``gc.freeze()`` by anyone else freezes it too."""


_marker: _Marker | None = None


def _collect_and_freeze() -> float:
    """Collect in full, freeze what is alive; the seconds it took."""
    global _count, _due, _marker
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    took = time.perf_counter() - t0
    _marker = _Marker()
    _count = gc.get_freeze_count()
    if cfg.get_env(cfg.GC_REFRESH_ENV_VAR):
        period = cfg.get_float(cfg.GC_REFRESH_ENV_VAR, cfg.DEFAULT_GC_REFRESH_S)
    else:  # the default: also at least _COST_SHARE times what a refresh costs here
        period = max(cfg.DEFAULT_GC_REFRESH_S, _COST_SHARE * took)
    _due = time.monotonic() + period if period > 0 else math.inf
    return took


def freeze_heap() -> None:
    """Collect, then freeze what is alive (``init()``, once the job is up)."""
    global _frozen_here
    if not cfg.get_bool(cfg.GC_FREEZE_ENV_VAR, True):
        return
    with _lock:
        if gc.get_freeze_count():
            log.debug(
                "the heap was already frozen (%d objects): left as it is", gc.get_freeze_count()
            )
            return
        took = _collect_and_freeze()
        _frozen_here = True
    log.debug(
        "froze %d objects for the collector in %.0f ms (%s=0 turns this off)",
        _count,
        took * 1e3,
        cfg.GC_FREEZE_ENV_VAR,
    )


def _user_froze() -> bool:
    """Someone froze the heap since ringcore's last freeze (under ``_lock``): the marker
    made after that freeze is frozen too, so ``gc.get_objects()`` (the objects not
    frozen: those made since the last refresh) no longer lists it."""
    global _frozen_here
    if any(o is _marker for o in gc.get_objects()):
        return False
    _frozen_here = False  # theirs now: no refresh, and shutdown() leaves it frozen
    log.debug("the heap was frozen again outside ringcore: no refresh, left frozen")
    return True


def refresh_if_due() -> bool:
    """Thaw, collect in full and freeze again once the period is over (the engine's
    sender thread); True when it did. One clock read when it is not due."""
    if time.monotonic() < _due:
        return False
    with _lock:
        if not _frozen_here or time.monotonic() < _due or _user_froze():
            return False
        gc.unfreeze()
        took = _collect_and_freeze()
    log.debug("refreshed the frozen heap (%d objects) in %.0f ms", _count, took * 1e3)
    return True


def thaw_heap() -> None:
    """Give what ``freeze_heap`` froze back to the collector (``shutdown()``)."""
    global _frozen_here, _due, _marker
    with _lock:
        if _frozen_here and not _user_froze():
            gc.unfreeze()
        _frozen_here = False
        _due = math.inf
        _marker = None
