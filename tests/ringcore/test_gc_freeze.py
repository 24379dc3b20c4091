"""``init()`` freezes the heap it finds for the garbage collector, refreshes it now and
then, and ``shutdown()`` thaws it (``ringcore.runtime.heap``): a full collection mid-job no longer
walks torch's ~170,000 import objects, garbage the freeze hid is freed within a refresh
period, a freeze the user made is left alone, and nothing stays frozen after the job.

Real ranks (``run_workers``); each rank checks the collector's own counts
(``gc.get_freeze_count``, ``gc.get_objects``) and a reference cycle's fate through a
weak reference.
"""

from __future__ import annotations

import gc
import os
import weakref

import pytest
from _reliability import record

from ringcore.testing import run_workers


class _Node:
    """A reference cycle (itself) that a weak reference can watch, holding ``nbytes``."""

    def __init__(self, nbytes: int = 0) -> None:
        self.me = self
        self.payload = bytearray(nbytes)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


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
    del node  # garbage now, but frozen: the collector does not look at it until a refresh
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
        assert r["frozen_after"] == 0, (rank, r)
        assert r["cycle_freed_after"], (rank, r)
        assert r["frozen_second_job"] > 0, (rank, r)
        assert r["frozen_after_second"] == 0, (rank, r)
        # a heap someone else froze: init() adds nothing, shutdown() thaws nothing
        assert r["theirs_in_job"] == 0, (rank, r)
        assert r["theirs_after"] == 0, (rank, r)
        assert r["frozen_when_off"] == 0, (rank, r)


def _refresh_worker() -> dict:
    """A 64 MiB model-like cycle built before init() and dropped in the job; a freeze the
    user makes after init()."""
    import time

    import torch

    import ringcore.torch as hvd

    os.environ["RING_GC_REFRESH_SECONDS"] = "0.2"
    out: dict = {}
    node = _Node(64 << 20)
    ref = weakref.ref(node)
    hvd.init()
    out["rss_before"] = _rss_mib()
    del node  # cyclic garbage now, frozen with the heap init() found
    t0 = time.monotonic()
    freed_at = None
    for _ in range(200):  # the job goes on meanwhile; every rank leaves at the same step
        if freed_at is None and ref() is None:
            freed_at = time.monotonic() - t0
        flag = torch.tensor([0.0 if freed_at is None else 1.0])
        if hvd.allreduce(flag, name="tick", op=hvd.Min).item() == 1.0:
            break
        time.sleep(0.05)
    out["freed_in_job_s"] = freed_at
    out["rss_after"] = _rss_mib()
    for _ in range(40):  # refreshed, not left thawed (a refresh may be under way now)
        if gc.get_freeze_count():
            break
        time.sleep(0.05)
    out["still_frozen"] = gc.get_freeze_count() > 0

    theirs = [object() for _ in range(3)] + [[]]
    gc.freeze()  # the user's own freeze, after init()
    hvd.shutdown()
    out["frozen_at_end"] = gc.get_freeze_count()
    out["user_freeze_kept"] = gc.get_freeze_count() > 0 and not any(
        o is theirs[-1] for o in gc.get_objects()
    )
    gc.unfreeze()
    return out


@pytest.mark.reliability(
    fault="garbage the collector freeze hid (a model built before init(), dropped in the job)",
    category="load",
)
def test_garbage_hidden_by_the_freeze_is_freed_in_the_job_and_a_users_freeze_survives_shutdown(
    request,
):
    """The freeze at init() pinned every object then alive that became cyclic garbage
    later until shutdown() (a 200 MB model kept RSS up for the whole job), and
    shutdown()'s gc.unfreeze() thawed a freeze the user made after init()."""
    results = run_workers(_refresh_worker, np=2, timeout=120)
    for rank, r in enumerate(results):
        assert r["freed_in_job_s"] is not None, (rank, sorted(r.items()))
        assert r["rss_before"] - r["rss_after"] > 48, (rank, r)
        assert r["still_frozen"], (rank, r)
        assert r["user_freeze_kept"], (rank, sorted(r.items()))
    worst = max(r["freed_in_job_s"] for r in results)
    drop = min(r["rss_before"] - r["rss_after"] for r in results)
    record(
        request,
        recover_s=worst,
        note=f"RING_GC_REFRESH_SECONDS=0.2; a 64 MiB cycle freed in the job, RSS down {drop:.0f} MiB",
    )
