"""``init()`` freezes the heap it finds for the garbage collector and ``shutdown()`` thaws
it (``ringcore._gc``): a full collection mid-job no longer walks torch's ~170,000 import
objects, and nothing stays frozen after the job.

Real ranks (``run_workers``); each rank checks the collector's own counts
(``gc.get_freeze_count``, ``gc.get_objects``) and a reference cycle's fate through a
weak reference.
"""

from __future__ import annotations

import gc
import os
import weakref

from ringcore.testing import run_workers


class _Node:
    """A reference cycle (itself) that a weak reference can watch."""

    def __init__(self) -> None:
        self.me = self


def _heap_worker() -> dict:
    import torch  # the import heap the freeze is for

    import ringcore.torch as hvd

    out: dict = {}
    gc.collect()
    out["tracked_before"] = len(gc.get_objects())

    # the default: frozen at init, thawed at shutdown
    node = _Node()
    ref = weakref.ref(node)
    hvd.init()
    out["frozen_in_job"] = gc.get_freeze_count()
    out["tracked_in_job"] = len(gc.get_objects())
    total = hvd.allreduce(torch.ones(4), op=hvd.Sum)  # the job works with the heap frozen
    out["sum"] = total.tolist()
    del node  # garbage now, but frozen: the collector does not look at it
    gc.collect()
    out["cycle_kept_in_job"] = ref() is not None
    hvd.shutdown()
    out["frozen_after"] = gc.get_freeze_count()
    gc.collect()
    out["cycle_freed_after"] = ref() is None

    # a second job in the same process freezes again
    hvd.init()
    out["frozen_second_job"] = gc.get_freeze_count()
    hvd.shutdown()
    out["frozen_after_second"] = gc.get_freeze_count()

    # a heap the user froze: left as it is, also by shutdown()
    gc.freeze()
    theirs = gc.get_freeze_count()
    hvd.init()
    out["theirs_in_job"] = gc.get_freeze_count() - theirs
    hvd.shutdown()
    out["theirs_after"] = gc.get_freeze_count() - theirs
    gc.unfreeze()

    # RING_GC_FREEZE=0: off
    os.environ["RING_GC_FREEZE"] = "0"
    hvd.init()
    out["frozen_when_off"] = gc.get_freeze_count()
    hvd.shutdown()
    return out


def test_init_freezes_the_heap_it_finds_and_shutdown_thaws_it():
    results = run_workers(_heap_worker, np=2, timeout=180)
    for rank, r in enumerate(results):
        assert r["sum"] == [2.0] * 4, (rank, r)
        # the imports and the job's start-up objects are out of the collector's walk
        assert r["frozen_in_job"] > 0.8 * r["tracked_before"], (rank, r)
        assert r["tracked_in_job"] < 0.1 * r["tracked_before"], (rank, r)
        # a cycle alive at init() that became garbage in the job is kept until shutdown()
        assert r["cycle_kept_in_job"], (rank, r)
        assert r["frozen_after"] == 0, (rank, r)
        assert r["cycle_freed_after"], (rank, r)
        assert r["frozen_second_job"] > 0, (rank, r)
        assert r["frozen_after_second"] == 0, (rank, r)
        # a heap someone else froze: init() adds nothing, shutdown() thaws nothing
        assert r["theirs_in_job"] == 0, (rank, r)
        assert r["theirs_after"] == 0, (rank, r)
        assert r["frozen_when_off"] == 0, (rank, r)
