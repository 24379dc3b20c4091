"""bench/sharded.py --quick runs end to end: every side (ring, ddp, fsdp under ringrun;
FSDP2 by hand under torchrun) trains the same 2-layer GPT-2 on 2 real ranks, they agree,
and the JSON says so; a worker held to a memory limit dies past it, and its cgroup is
recorded and removed.

No figure is asserted: the quick model is too small for sharding to pay (its peak RSS is
the runtime's). The quick run skips the limit runs (two more launches of each side, about
30 s): the limit's mechanism is tested on its own below, the limit runs by the full
benchmark.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _load_memlimit():
    """bench/_memlimit.py, loaded from its file: bench/ never goes on sys.path, where its
    keras.py (the Keras benchmark) would stand in for the keras package of every test
    that runs after this module in the same process."""
    spec = importlib.util.spec_from_file_location("_memlimit", ROOT / "bench" / "_memlimit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_memlimit = _load_memlimit()


def _cgroups_left() -> list[pathlib.Path]:
    _, where, _ = _memlimit.probe()
    return [] if where is None else sorted(where.glob("ringbench-*"))


@pytest.mark.timeout(400)
def test_sharded_quick_runs_every_side_on_two_ranks_and_they_agree(tmp_path):
    before = _cgroups_left()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sharded.py"), "--quick", "--out", str(tmp_path),
         "--no-limit"],
        capture_output=True, text=True, timeout=380, env=env, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "sharded.json").read_text())
    assert report["schema"] == 2 and report["quick"] is True and report["rounds"] == 1
    assert len(report["environment"]["commit"]) == 40
    assert report["environment"]["versions"]["transformers"]
    assert report["checks_passed"] is True, report["checks"]
    assert set(report["rows"]) == {"ring", "ddp", "fsdp", "fsdp2_by_hand"}
    for side in report["rows"].values():
        assert side["samples_per_s"]["n"] == 1 and side["samples_per_s"]["median"] > 0
        assert all(len(r) == 2 and min(r) > 0 for r in side["peak_rss_per_rank"])
    for t in report["targets"]:
        assert set(t) >= {"target", "value", "goal", "met"}
        assert t["met"] is True or t["why_missed"], t
    assert "skipped" in report["memory_limit"]
    assert _cgroups_left() == before  # collect() removed every cgroup it made


_HOG = """
import sys
sys.path.insert(0, {bench!r})
import _memlimit
_memlimit.join({mode!r}, {parent!r}, {limit})
block = bytearray({size})  # touched: zero-filled pages count
print("survived", flush=True)
"""


@pytest.mark.parametrize("size_mib, survives", [(32, True), (512, False)])
def test_a_worker_joins_its_own_limit_and_dies_past_it(size_mib, survives):
    mode, where, why = _memlimit.probe()
    if mode == "rlimit_as":
        pytest.skip(why)
    parent = _memlimit.make_parent(mode, where)
    limit = 256 * 2**20
    code = _HOG.format(
        bench=str(ROOT / "bench"), mode=mode, parent=str(parent), limit=limit,
        size=size_mib * 2**20,
    )  # fmt: skip
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    finally:
        workers = _memlimit.collect(mode, parent)
    assert (proc.returncode == 0) is survives, proc.stderr[-1000:]
    assert len(workers) == 1 and workers[0]["limit"] == limit, workers
    assert bool(workers[0]["oom_kill"]) is not survives, workers
    assert parent is not None and not parent.exists()
