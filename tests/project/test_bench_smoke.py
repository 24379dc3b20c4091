"""bench/collectives.py, bench/training.py and bench/torch_backend.py --quick run end to
end and write the shared schema.

Real ranks (mpiexec or run_workers, real Gloo on 127.0.0.1), small sizes, still >= 5
rounds: the JSON must record the commit, versions, machine and load, per-row medians
with their spread, checks that passed (both sides computed the same), and every target
met, missed with a reason, or marked as not measured. No timing is asserted.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _run(script: str, out: pathlib.Path) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--quick", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, f"{script} --quick failed:\n{proc.stderr[-3000:]}"
    return json.loads((out / script.replace(".py", ".json")).read_text())


def _common_schema(report: dict) -> None:
    assert report["schema"] == 2 and report["quick"] is True and report["rounds"] >= 5
    env = report["environment"]
    assert len(env["commit"]) == 40 and isinstance(env["dirty"], bool)
    assert env["versions"]["python"] and env["versions"]["torch"]
    machine = env["machine"]
    assert machine["cores"] >= 1 and machine["cpu_model"]
    assert len(machine["load_before"]) == 3 and len(machine["load_after"]) == 3
    assert "RING_SHM" in env
    assert report["checks"] and report["checks_passed"] is True, report["checks"]
    for t in report["targets"]:
        assert t["met"] in (True, False, None)
        if t["met"] is not True:
            assert t["why_missed"], t
    assert report["table"]["rows"] and all(
        len(r) == len(report["table"]["headers"]) for r in report["table"]["rows"]
    )


def _assert_summary(s: dict, rounds: int) -> None:
    assert s["n"] == rounds == len(s["all"])
    assert s["min"] <= s["q1"] <= s["median"] <= s["q3"] <= s["max"]


@pytest.mark.timeout(300)
def test_collectives_quick_writes_the_schema(tmp_path):
    report = _run("collectives.py", tmp_path)
    _common_schema(report)
    rows = {(r["op"], r["bytes"]): r for r in report["rows"]}
    small = rows[("allreduce", 4096)]
    assert {"ours", "gloo"} <= set(small["peers"])
    for row in report["rows"]:
        assert row["check"]["passed"], row["check"]
        for peer in row["peers"].values():
            _assert_summary(peer["seconds_per_op"], report["rounds"])
            assert len(peer["per_rank"]) == report["np"]  # every rank measured itself
    burst = next(r for r in report["rows"] if r["op"].endswith("x allreduce 4KB"))
    assert {"ours", "gloo", "gloo_async_op", "gloo_flat"} <= set(burst["peers"])
    names = [t["target"] for t in report["targets"]]
    assert any("MPICH" in n for n in names) and any("0.025x" in n for n in names)
    assert any("Horovod" in n for n in names)
    planes = report["data_plane_per_rank"]  # what carried ours' bytes, per rank
    assert len(planes) == report["np"] and all(p["backend"] for p in planes), planes


@pytest.mark.timeout(300)
def test_training_quick_writes_the_schema(tmp_path):
    report = _run("training.py", tmp_path)
    _common_schema(report)
    assert {r["model"] for r in report["rows"]} == {"mlp", "convnet"}
    for row in report["rows"]:
        assert set(row["peers"]) == {"ours", "ddp", "ddp_tuned", "no_comm"}
        for peer in row["peers"].values():
            _assert_summary(peer["samples_per_s"], report["rounds"])
    assert any("weights" in c["check"] for c in report["checks"])
    assert all(len(r["ours_data_plane_per_rank"]) == 2 for r in report["rows"])


@pytest.mark.timeout(300)
def test_torch_backend_quick_writes_the_schema(tmp_path):
    report = _run("torch_backend.py", tmp_path)
    _common_schema(report)
    assert [r["parallel"] for r in report["rows"]] == ["ddp", "fsdp"]
    for row in report["rows"]:
        assert set(row["peers"]) == {"ring", "gloo", "no_comm"}
        for peer in row["peers"].values():
            _assert_summary(peer["samples_per_s"], report["rounds"])
        assert all(stats["shm"] > 0 for stats in row["ring_stats_per_rank"])


def _probe_plane() -> dict:
    sys.path.insert(0, str(ROOT / "bench"))
    import _common
    import torch

    import ringcore.torch as hvd

    hvd.init()
    try:
        hvd.allreduce(torch.ones(1024), name="probe")
        return _common.data_plane()
    finally:
        hvd.shutdown()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shm", ["1", "0"])
def test_data_plane_says_which_path_carried_ours(shm):
    from ringcore.testing import run_workers

    for plane in run_workers(_probe_plane, np=2, timeout=100, env={"RING_SHM": shm}):
        assert plane["backend"] == "gloo"
        if shm == "1":  # two ranks on one host: the shared-memory plane carried the op
            assert plane["mode"] == "flat" and plane["shm"] == ["flat"], plane
            assert plane["ops"]["shm"] >= 1 and plane["ops"]["network"] == 0, plane
        else:
            assert plane["mode"] == "network" and plane["shm"] == [], plane
