"""The collector's view of the heap while a rank is in a job: frozen at ``init()``,
thawed at ``shutdown()``.

A full collection walks every tracked object of the process. With torch imported
that is ~170,000 objects, almost all of them from imports, and one collection holds
the GIL for ~90 ms on this project's test machines. The engine's per-op objects (a
handle, its event, a key) survive the young collections of a burst of async ops, so
about every 10th young-generation pass a full one runs: a 1,000-op burst that takes
20 ms takes ~110 ms, on each rank in turn, and every rank waits for the slowest.

``init()`` therefore collects once and then ``gc.freeze()``s what is alive (the
imports, the job's connections): the collector no longer walks it, so a full
collection costs about what the young ones do. Everything made later (the model, the
optimizer, per-step tensors) is tracked and collected as before. ``shutdown()``
``gc.unfreeze()``s it again, so whatever of it became cyclic garbage during the job
is collected after it, and a process that runs several jobs (a reused Spark Python
worker, a notebook kernel) keeps nothing for good.

A heap already frozen at ``init()`` (``gc.get_freeze_count()`` > 0: someone else
froze it) is left as it is, and ``shutdown()`` thaws only what ``init()`` froze; an
``init()`` after ``shutdown()`` freezes again. ``RING_GC_FREEZE=0`` turns this off.
"""

from __future__ import annotations

import gc
import logging
import time

from . import _config as cfg

__all__ = ["freeze_heap", "thaw_heap"]

log = logging.getLogger("ringtrain.ringcore")

_frozen_here = False


def freeze_heap() -> None:
    """Collect, then freeze what is alive (``init()``, once the job is up)."""
    global _frozen_here
    if not cfg.get_bool(cfg.GC_FREEZE_ENV_VAR, True):
        return
    if gc.get_freeze_count():
        log.debug("the heap was already frozen (%d objects): left as it is", gc.get_freeze_count())
        return
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    _frozen_here = True
    log.debug(
        "froze %d objects for the collector in %.0f ms (%s=0 turns this off)",
        gc.get_freeze_count(),
        (time.perf_counter() - t0) * 1e3,
        cfg.GC_FREEZE_ENV_VAR,
    )


def thaw_heap() -> None:
    """Give what ``freeze_heap`` froze back to the collector (``shutdown()``)."""
    global _frozen_here
    if _frozen_here:
        gc.unfreeze()
        _frozen_here = False
