"""The MPI backend under a real ``mpirun`` (the mpich wheel's, in the venv)."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

MPIRUN = pathlib.Path(sys.executable).with_name("mpirun")
pytestmark = pytest.mark.skipif(
    not MPIRUN.exists() and shutil.which("mpirun") is None,
    reason="mpirun is not installed (pip install 'ringtrain[mpi]')",
)

SCRIPT = r"""
import json, torch
import ringcore.torch as hvd

hvd.init()
r = hvd.rank()
out = {
    "rank": r, "size": hvd.size(), "local_rank": hvd.local_rank(), "mpi": hvd.mpi_enabled(),
    "sum": hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item(),
    "avg16": hvd.allreduce(torch.full((3,), float(r), dtype=torch.float16)).tolist(),
    "gather": hvd.allgather(torch.arange(r + 1)).tolist(),
    "bcast": hvd.broadcast(torch.tensor([r * 5]), 1).tolist(),
    "a2a": [t.tolist() for t in hvd.alltoall(torch.arange(4) + 10 * r, splits=[1, 3] if r == 0 else [2, 2])],
    "rs": hvd.reducescatter(torch.ones(3, 2), op=hvd.Sum).tolist(),
    "objects": hvd.allgather_object({"r": r}),
}
try:
    hvd.allreduce(torch.zeros(r + 1), name="bad")
except hvd.CollectiveMismatchError as exc:
    out["mismatch"] = str(exc)
hvd.barrier()
hvd.shutdown()
with open(f"result.{r}.json", "w") as f:  # files, not stdout: mpirun interleaves output
    json.dump(out, f)
"""


def test_mpirun_runs_every_collective_through_mpi(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    mpirun = str(MPIRUN) if MPIRUN.exists() else shutil.which("mpirun")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    proc = subprocess.run(
        [mpirun, "-n", "2", sys.executable, str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(2)]
    assert [r["rank"] for r in results] == [0, 1]
    for res in results:
        assert res["size"] == 2 and res["mpi"] is True
        assert res["sum"] == 3.0
        assert res["avg16"] == [0.5] * 3
        assert res["gather"] == [0, 0, 1]
        assert res["bcast"] == [5]
        assert res["objects"] == [{"r": 0}, {"r": 1}]
        assert "'bad'" in res["mismatch"] and "shape" in res["mismatch"]
    assert results[0]["a2a"] == [[0, 10, 11], [1, 2]]
    assert results[1]["a2a"] == [[1, 2, 3, 12, 13], [3, 2]]
    assert results[0]["rs"] == [[2.0, 2.0], [2.0, 2.0]] and results[1]["rs"] == [[2.0, 2.0]]
    assert [r["local_rank"] for r in results] == [0, 1]
