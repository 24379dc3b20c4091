"""The four torch.distributed programs of tests/_torch_programs.py (DDP with env://,
FSDP2, Lightning's own DDPStrategy, a Hugging Face Trainer), run one after another in
each rank's process: under the real torchrun (the reference), then unchanged under
ringtrain's own local launchers — ``ringrun`` (the script) and
``ringcore.testing.run_workers`` (the functions). Every launcher's ranks agree on the
world size and end with the same parameters as torchrun's ranks do (the digests are
equal: the same data, the same steps, the same averaging). The Spark and Ray launchers
run them in their own modules (tests/spark_runner, tests/ray_runner)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import _torch_programs

from ringcore.testing import run_workers

MAIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_torch_programs_main.py")
PROGRAMS = ("ddp", "fsdp2", "lightning_ddp", "hf_trainer")


def _launch(cmd: list[str], cwd: str, timeout_s: float = 150) -> str:
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=cwd,
        start_new_session=True,  # on a timeout, its ranks end with it
    )
    try:
        output, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-6000:]
    return output


def _in_step(ranks: list[dict]) -> dict[str, str]:
    """Each program's digest, after checking that the ranks trained in step."""
    digests = {}
    for name in PROGRAMS:
        seen = [rank[name] for rank in ranks]
        assert [s["rank"] for s in seen] == [0, 1], (name, seen)
        assert [s["world_size"] for s in seen] == [2, 2], (name, seen)
        assert seen[0]["digest"] == seen[1]["digest"], (name, seen)
        digests[name] = seen[0]["digest"]
    return digests


@pytest.fixture(scope="module")
def under_torchrun(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("torchrun")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _launch([*cmd, MAIN, str(tmp / "out")], str(tmp))
    return _in_step([json.loads((tmp / "out" / f"rank{r}.json").read_text()) for r in (0, 1)])


@pytest.mark.slow
def test_every_program_trains_in_step_on_both_ranks_under_torchrun(under_torchrun):
    assert set(under_torchrun) == set(PROGRAMS)


@pytest.mark.slow
def test_ringrun_runs_the_programs_script_as_torchrun_does(under_torchrun, tmp_path):
    _launch(
        [sys.executable, "-m", "ringrun", "-np", "2", sys.executable, MAIN, str(tmp_path / "out")],
        str(tmp_path),
    )
    ranks = [json.loads((tmp_path / "out" / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert _in_step(ranks) == under_torchrun


@pytest.mark.slow
def test_run_workers_runs_the_programs_functions_as_torchrun_runs_the_script(under_torchrun):
    ranks = run_workers(_torch_programs.run_all, np=2, timeout=150)
    assert _in_step(ranks) == under_torchrun
