"""The reference for the launcher tests: the four torch.distributed programs of
tests/_torch_programs.py (DDP, FSDP2, a Lightning Trainer, a Hugging Face Trainer) run,
one after another in each rank's process, under the real torchrun. Their ranks agree on
the world size and end with the same parameters, independent of any ringtrain launcher.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

pytest.importorskip("lightning")
pytest.importorskip("transformers")

MAIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_torch_programs_main.py")
PROGRAMS = ("ddp", "fsdp2", "lightning_ddp", "hf_trainer")


@pytest.mark.slow
def test_every_program_trains_in_step_on_both_ranks_under_torchrun(tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.Popen(
        [*cmd, MAIN, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=tmp_path,
        start_new_session=True,  # on a timeout, its ranks end with torchrun
    )
    try:
        output, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
    assert proc.returncode == 0, output[-6000:]
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in PROGRAMS:
        seen = [rank[name] for rank in ranks]
        assert [s["rank"] for s in seen] == [0, 1], (name, seen)
        assert [s["world_size"] for s in seen] == [2, 2], (name, seen)
        assert seen[0]["digest"] == seen[1]["digest"], (name, seen)
