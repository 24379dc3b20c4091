"""ringrun, the command-line launcher: ranks started as commands, on this host and through
the ssh seam (``RINGRUN_SSH``: a script in ssh's place that runs the rank's line here, so
the remote path — ``ringrun._remote``, the rank sent over ssh's input, the group ended
on end of input — runs without other hosts; tests/end_to_end/test_multihost.py runs it
across network-namespace hosts). Ranks are plain Python processes that print their
environment: no torch in them."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import psutil
import pytest
from _netns import alive
from _reliability import record

import ringrun
from ringrun._args import parse

ROOT = pathlib.Path(__file__).resolve().parents[2]

# what each rank prints: its environment's launcher variables, one JSON line
_SHOW_ENV = (
    "import json, os; print(json.dumps({k: v for k, v in os.environ.items() "
    "if k.startswith(('RING_', 'MASTER_', 'GLOO_')) or k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
    "'LOCAL_WORLD_SIZE', 'GROUP_RANK', 'GROUP_WORLD_SIZE', 'TORCHELASTIC_RUN_ID', 'FROM_RINGRUN')}))"
)
# each rank starts a grandchild (sleep), prints its pid, then sleeps itself
_GRANDCHILD = (
    "import subprocess, time; p = subprocess.Popen(['sleep', '60']); "
    "print('grandchild', p.pid, flush=True); time.sleep(60)"
)
# ssh's place: drop ssh's options, note the host, run the remote line on this host
_FAKE_SSH = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -o|-p|-i) shift 2;; -*) shift;; *) break;; esac; done
echo "$1" >> "$(dirname "$0")/hosts.log"
exec sh -c "$2"
"""
_ELSEWHERE = "192.0.2.1"  # TEST-NET-1: never an address of this machine


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return {**env, **extra}


def _ringrun(args: list[str], cwd: pathlib.Path, timeout: float = 60, **env: str):
    return subprocess.run(
        [sys.executable, "-m", "ringrun", *args],
        cwd=cwd,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _by_rank(stdout: str) -> dict[int, dict]:
    out = {}
    for line in stdout.splitlines():
        if line.startswith("[") and "]<stdout>:{" in line:
            rank, text = line[1:].split("]<stdout>:", 1)
            out[int(rank)] = json.loads(text)
    return out


@pytest.fixture
def fake_ssh(tmp_path):
    script = tmp_path / "ssh.sh"
    script.write_text(_FAKE_SSH)
    script.chmod(0o755)
    return script


def test_two_local_ranks_print_prefixed_lines_with_the_ring_and_torchrun_variables(tmp_path):
    flags = ["--fusion-threshold-mb", "2", "--cycle-time-ms", "3.5", "--autotune",
             "--timeline-filename", "tl.json", "--network-interface", "lo"]  # fmt: skip
    cmd = [sys.executable, "-c", _SHOW_ENV + "; import sys; print('done', file=sys.stderr)"]
    done = _ringrun(["-np", "2", *flags, *cmd], tmp_path)
    assert done.returncode == 0, done.stderr
    ranks = _by_rank(done.stdout)
    assert sorted(ranks) == [0, 1]
    assert sorted(done.stderr.splitlines()) == ["[0]<stderr>:done", "[1]<stderr>:done"]
    for r, env in ranks.items():
        assert (env["RANK"], env["RING_RANK"], env["LOCAL_RANK"]) == (str(r),) * 3
        assert (env["WORLD_SIZE"], env["RING_SIZE"], env["GROUP_WORLD_SIZE"]) == ("2", "2", "1")
        assert env["MASTER_ADDR"] == env["RING_STORE_ADDR"] == "127.0.0.1"
        assert env["MASTER_PORT"] != env["RING_STORE_PORT"]
        assert env["RING_STORE_EXTERNAL"] == "1" and len(env["RING_SECRET_KEY"]) >= 32
        assert env["RING_FUSION_THRESHOLD"] == str(2 * 1024 * 1024)
        assert (env["RING_CYCLE_TIME"], env["RING_AUTOTUNE"]) == ("3.5", "1")
        assert env["RING_TIMELINE"] == str(tmp_path / "tl.json")
        assert env["RING_IFACE"] == env["GLOO_SOCKET_IFNAME"] == "lo"
    one_job = ("MASTER_PORT", "RING_STORE_PORT", "RING_SECRET_KEY", "TORCHELASTIC_RUN_ID")
    assert all(ranks[0][k] == ranks[1][k] for k in one_job)


# a torch.distributed program that names the backend "ring" and imports no ringcore
_RING_PROGRAM = """
import json, torch, torch.distributed as dist
dist.init_process_group("cpu:ring")
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    opt.zero_grad()
    model(torch.full((8, 4), float(dist.get_rank() + 1))).sum().backward()
    opt.step()
group = dist.group.WORLD
print(json.dumps({"backend": dist.get_backend(), "shm": group.stats["shm"],
                  "weights": [round(float(p.sum()), 6) for p in model.parameters()]}))
dist.destroy_process_group()
"""


def test_a_program_run_by_ringrun_names_the_ring_backend_without_importing_ringcore(tmp_path):
    (tmp_path / "prog.py").write_text(_RING_PROGRAM)
    proc = _ringrun(["-np", "2", sys.executable, "prog.py"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    ranks = _by_rank(proc.stdout)
    assert sorted(ranks) == [0, 1], proc.stdout
    for r in ranks.values():  # DDP's gradients went through the shared-memory plane
        assert r["backend"] == "cpu:ring" and r["shm"] > 0, r
    assert ranks[0]["weights"] == ranks[1]["weights"]


def test_ranks_are_numbered_host_by_host_in_the_order_of_dash_h(tmp_path):
    done = _ringrun(["-np", "3", "-H", "localhost:1,127.0.0.1:2",
                     sys.executable, "-c", _SHOW_ENV], tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    ranks = _by_rank(done.stdout)
    hosts = [ranks[r]["RING_HOSTNAME"] for r in range(3)]
    assert hosts == ["localhost", "127.0.0.1", "127.0.0.1"]
    assert [ranks[r]["LOCAL_RANK"] for r in range(3)] == ["0", "0", "1"]
    assert [ranks[r]["GROUP_RANK"] for r in range(3)] == ["0", "1", "1"]
    # Horovod's cross rank: among the hosts that have this local rank
    assert [ranks[r]["RING_CROSS_RANK"] for r in range(3)] == ["0", "1", "0"]


def test_ranks_on_another_host_run_through_ssh_with_the_environment_sent_on_its_input(
    tmp_path, fake_ssh
):
    done = _ringrun(["-np", "2", "-H", f"{_ELSEWHERE}:2", "--network-interface", "lo",
                     sys.executable, "-c", _SHOW_ENV], tmp_path,
                    RINGRUN_SSH=str(fake_ssh), FROM_RINGRUN="kept")  # fmt: skip
    assert done.returncode == 0, done.stderr
    ranks = _by_rank(done.stdout)
    assert [ranks[r]["RING_HOSTNAME"] for r in (0, 1)] == [_ELSEWHERE, _ELSEWHERE]
    assert all(env["FROM_RINGRUN"] == "kept" for env in ranks.values())  # forwarded
    assert ranks[0]["RING_STORE_ADDR"] == "127.0.0.1"  # --network-interface lo's address
    # rank 0 is remote: MASTER_PORT was asked of its host (one more ssh), before the ranks
    assert ranks[0]["MASTER_ADDR"] == _ELSEWHERE
    assert (tmp_path / "hosts.log").read_text().split() == [_ELSEWHERE] * 3
    # the secret travelled on ssh's input: no command line that ssh got holds it
    assert ranks[0]["RING_SECRET_KEY"] not in fake_ssh.read_text() + done.stderr


@pytest.mark.reliability(fault="a rank of a ringrun job exits non-zero", category="fault")
@pytest.mark.parametrize("where", ["local", "ssh"])
def test_a_rank_that_exits_3_makes_ringrun_exit_3_and_ends_the_sleeping_rank(
    request, tmp_path, fake_ssh, where
):
    job = (
        "import os, sys, time; r = os.environ['RANK']; time.sleep(60) if r == '0' else sys.exit(3)"
    )
    hosts = ["-H", f"{_ELSEWHERE}:2", "--network-interface", "lo"] if where == "ssh" else []
    started = time.monotonic()
    done = _ringrun(["-np", "2", *hosts, sys.executable, "-c", job], tmp_path,
                    RINGRUN_SSH=str(fake_ssh))  # fmt: skip
    elapsed = time.monotonic() - started
    assert done.returncode == 3, done.stderr
    assert "rank 1 on" in done.stderr and "exited with code 3" in done.stderr
    assert elapsed < 20  # not the 60 s rank 0 sleeps: it was ended
    record(request, detect_s=elapsed)


def _wait_for_lines(proc: subprocess.Popen, word: str, count: int, timeout: float) -> list[str]:
    found: list[str] = []
    deadline = time.monotonic() + timeout
    while len(found) < count and time.monotonic() < deadline:
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        if word in line:
            found.append(line)
    return found


def _started(pid: int) -> float | None:
    """When ``pid`` started: with the pid, it names one process (pids are reused)."""
    try:
        return psutil.Process(pid).create_time()
    except psutil.Error:
        return None


def _commands(pids: list[int]) -> dict[int, str]:
    out = {}
    for pid in pids:
        try:
            out[pid] = " ".join(psutil.Process(pid).cmdline())
        except psutil.Error:
            out[pid] = "?"
    return out


@pytest.mark.reliability(fault="Ctrl-C to ringrun", category="fault")
@pytest.mark.parametrize("where", ["local", "ssh"])
def test_ctrl_c_ends_every_rank_and_the_processes_they_started(tmp_path, fake_ssh, where):
    hosts = ["-H", f"{_ELSEWHERE}:2", "--network-interface", "lo"] if where == "ssh" else []
    proc = subprocess.Popen(
        [sys.executable, "-m", "ringrun", "-np", "2", *hosts, sys.executable, "-c", _GRANDCHILD],
        cwd=tmp_path, env=_env(RINGRUN_SSH=str(fake_ssh)),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        lines = _wait_for_lines(proc, "grandchild", 2, timeout=30)
        assert len(lines) == 2, proc.stderr.read() if proc.poll() is not None else lines
        pids = [int(line.split()[-1]) for line in lines]
        grandchildren = {p: _started(p) for p in pids}
        assert all(alive(p) for p in grandchildren)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=20) == 130

        def left() -> list[int]:  # the same processes, not others that reuse their pids
            return [p for p, t in grandchildren.items() if alive(p) and _started(p) == t]

        deadline = time.monotonic() + 10
        while left() and time.monotonic() < deadline:
            time.sleep(0.1)
        if left():  # what ringrun said, and what the survivor is
            err = proc.stderr.read()[-3000:]  # type: ignore[union-attr]
            pytest.fail(f"a grandchild outlived ringrun: {_commands(left())}\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


BAD = [
    (["-np", "2", "--fusion-mb", "2"], "unrecognized arguments: --fusion-mb"),
    (["-np", "2", "-H", "a:two"], "'a:two' gives 'two' slots"),
    (["-np", "2", "-H", "a b:1"], "'a b:1' is not host or host:slots"),
    (["-np", "2", "-H", "a:1,a:1"], "the host 'a' is listed twice"),
    (["-np", "5", "-H", "a:2,b:2"], "-np 5 but the hosts (a:2,b:2) have 4 slots"),
    (["-np", "0"], "-np 0: the number of ranks must be >= 1"),
    (["-np", "2", "--spark", "-H", "a:2"], "the cluster places the ranks"),
    (["-np", "2", "--min-np", "1", "--mpi"], "drop --mpi"),
    (["-np", "2", "--master", "local[2]"], "add --spark"),
    (["-np", "2", "--hostfile", "/nonexistent/hosts"], "'/nonexistent/hosts' does not exist"),
]


@pytest.mark.reliability(
    fault="bad ringrun command lines", category="bad-input", cases=len(BAD) + 1
)
def test_bad_command_lines_are_refused_with_the_value_before_anything_starts(tmp_path, capsys):
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for args, message in BAD:
        assert ringrun.main([*args, *command]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
    assert ringrun.main(["-np", "1", "no-such-program-here"]) == 2
    assert "'no-such-program-here' is not an executable file" in capsys.readouterr().err
    assert not marker.exists()


def test_a_hostfile_gives_slots_as_horovodrun_reads_it(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# the cluster\nnode1 slots=4\nnode2:2\nnode3\n")
    opts = parse(["-np", "6", "--hostfile", str(hostfile), "python", "train.py", "-np", "9"])
    assert opts.hosts == (("node1", 4), ("node2", 2), ("node3", 1))
    assert opts.command == ("python", "train.py", "-np", "9")  # after the command: its own


_PROGRAMS_MAIN = os.path.join(os.path.dirname(os.path.dirname(__file__)), "_torch_programs_main.py")


def _programs_then_exit_4(tmp_path) -> list[str]:
    """The four torch.distributed programs' script; rank 1 then exits 4."""
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    return [sys.executable, _PROGRAMS_MAIN, str(tmp_path / "out"), "--rank-1-exits=4"]


def _assert_programs_in_step(out) -> None:
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    for name in ranks[0]:
        seen = [r[name] for r in ranks]
        assert [(x["rank"], x["world_size"]) for x in seen] == [(0, 2), (1, 2)], name
        assert seen[0]["digest"] == seen[1]["digest"], name


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_spark_runs_the_command_in_each_barrier_task_and_exits_with_a_ranks_status(tmp_path):
    pytest.importorskip("pyspark")
    done = _ringrun(["--spark", "--master", "local[2]", "-np", "2", *_programs_then_exit_4(tmp_path)],
                    tmp_path, timeout=170)  # fmt: skip
    assert done.returncode == 4, done.stderr[-3000:]
    assert "[0]<stdout>:rank 0 ran" in done.stdout and "[1]<stdout>:rank 1 ran" in done.stdout
    assert "rank 1 on" in done.stderr
    _assert_programs_in_step(tmp_path / "out")


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_ray_runs_the_command_in_each_actor_and_exits_with_a_ranks_status(tmp_path):
    pytest.importorskip("ray")
    done = _ringrun(["--ray", "-np", "2", *_programs_then_exit_4(tmp_path)], tmp_path,
                    timeout=170)  # fmt: skip
    assert done.returncode == 4, done.stderr[-3000:]
    assert "[0]<stdout>:rank 0 ran" in done.stdout and "[1]<stdout>:rank 1 ran" in done.stdout
    _assert_programs_in_step(tmp_path / "out")
