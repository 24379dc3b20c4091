"""The torchrun contract in run_workers and the core: a torch.distributed program runs
unchanged, and ringcore and the program share one process group whoever forms it first."""

from __future__ import annotations

import os
import sys

import pytest

from ringcore import CommandFailedError, RendezvousError, WorkerError
from ringcore.launch import check_script, run_command, script_command, torchrun_env
from ringcore.rendezvous.topology import topology_from_hosts
from ringcore.testing import run_workers


def _programs_in_sequence() -> dict:
    """What a worker sees, then three programs one after the other in one process."""
    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd

    seen = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "GROUP_RANK")}
    port = int(os.environ["MASTER_PORT"])
    assert port != int(os.environ["RING_STORE_PORT"])  # never ringcore's store port
    # 0. three programs' groups one after another, each store kept alive (as FSDP2's and
    # Lightning's objects keep theirs): torch's env:// alone reuses the group's keys
    kept, cycles = [], []
    for i in range(3):
        dist.init_process_group("gloo")
        kept.append(dist.distributed_c10d._get_default_store())
        c = torch.tensor([float(i + dist.get_rank())])
        dist.all_reduce(c)
        cycles.append(float(c))
        dist.destroy_process_group()
    # 1. the user's program first (env://), then hvd.init() in the same process
    dist.init_process_group("gloo")
    hvd.init()
    adopted = float(hvd.allreduce(torch.tensor([dist.get_rank() + 1.0]), op=hvd.Sum))
    hvd.shutdown()
    dist.destroy_process_group()
    # 2. hvd.init() first, then the program's own init_process_group(): ringcore's group
    hvd.init()
    dist.init_process_group(backend="gloo")
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    shared = float(t)
    # 3. a program that names another world size than the launcher's
    try:
        dist.init_process_group("gloo", rank=dist.get_rank(), world_size=5)
        mismatch = ""
    except RendezvousError as exc:
        mismatch = str(exc)
    hvd.shutdown()
    return {
        "seen": seen,
        "port": port,
        "cycles": cycles,
        "adopted": adopted,
        "shared": shared,
        "mismatch": mismatch,
    }


def test_a_torch_distributed_program_and_hvd_share_the_launchers_group_either_way():
    results = run_workers(_programs_in_sequence, np=2, hosts=["a", "a"], timeout=60)
    assert [r["seen"]["RANK"] for r in results] == ["0", "1"]
    assert {r["seen"]["WORLD_SIZE"] for r in results} == {"2"}
    assert [r["seen"]["LOCAL_RANK"] for r in results] == ["0", "1"]
    assert {r["seen"]["GROUP_RANK"] for r in results} == {"0"}
    assert len({r["port"] for r in results}) == 1  # the user's port, the same on every rank
    assert [r["cycles"] for r in results] == [[1.0, 3.0, 5.0]] * 2
    assert [r["adopted"] for r in results] == [3.0, 3.0]
    assert [r["shared"] for r in results] == [3.0, 3.0]
    for r in results:
        assert "world_size=5" in r["mismatch"] and "of 2" in r["mismatch"]


def test_torchrun_env_numbers_hosts_in_rank_order_for_group_rank():
    hosts = ["h1", "h1", "h2", "h2", "h3"]
    env = torchrun_env(topology_from_hosts(hosts, 3), "h1", 29500, "job")
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("3", "5", "1")
    assert (env["LOCAL_WORLD_SIZE"], env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == ("2", "1", "3")
    assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == ("3", "5")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["TORCHELASTIC_RUN_ID"]) == (
        "h1",
        "29500",
        "job",
    )


def test_scripts_are_checked_before_any_job(tmp_path):
    text = tmp_path / "notes.txt"
    text.write_text("x")
    with pytest.raises(FileNotFoundError, match=r"missing\.py"):
        check_script(str(tmp_path / "missing.py"))
    with pytest.raises(ValueError, match=r"notes.txt.*not a Python file"):
        check_script(str(text))
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(TypeError, match=r"argument 1 .* 3 \(int\).*str\(3\)"):
        check_script(str(script), ["--epochs", 3])
    with pytest.raises(TypeError, match="list of strings"):
        check_script(str(script), "--epochs 3")


def test_a_script_runs_as_python_would_and_its_exit_code_comes_back(tmp_path, capfd):
    script = tmp_path / "prog.py"
    (tmp_path / "helper_mod.py").write_text("VALUE = 'from the script folder'\n")
    script.write_text(
        "import sys, helper_mod\n"
        "print(__name__, sys.argv[1:], helper_mod.VALUE)\n"
        "sys.exit(int(sys.argv[1]))\n"
    )
    path, args = check_script(str(script), ["0"])
    assert run_command(script_command(path, args), cwd=os.fspath(tmp_path.parent)) == 0
    assert "__main__ ['0'] from the script folder" in capfd.readouterr().out
    with pytest.raises(CommandFailedError, match="exited with code 3") as info:
        run_command(script_command(path, ["3"]))
    assert info.value.exit_code == 3
    assert WorkerError.from_exception(1, "h", info.value).exit_code == 3
    assert WorkerError.from_exception(1, "h", SystemExit(4)).exit_code == 4


def test_a_command_ended_by_a_signal_says_so():
    with pytest.raises(CommandFailedError, match="ended by signal 9"):
        run_command([sys.executable, "-c", "import os; os.kill(os.getpid(), 9)"])
