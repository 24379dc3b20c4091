"""ringrun's elastic mode (as horovodrun's): a discovery script whose hosts change, a
worker lost, too few workers for too long, bad elastic flags. Each worker is a small
``ringcore.torch.elastic`` job: a counter of steps, each step adding the ring's size
(an allreduce of ones), committed every step; every (re)start of the function prints
the worker's torchrun variables and ring, the end its final state."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest
from _reliability import record

import ringrun
from ringrun._discovery import DiscoveryError, parse_hosts

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)

# argv: STEPS WANT [DIE_AT]: run until STEPS steps were taken in a ring of WANT workers;
# with DIE_AT, worker 1 SIGKILLs itself once, after the allreduce of that step
_TRAIN = """
import json, os, signal, sys, time
import torch
import ringcore.torch as hvd
from ringcore.torch import elastic

steps, want = int(sys.argv[1]), int(sys.argv[2])
die_at = int(sys.argv[3]) if len(sys.argv) > 3 else None
hvd.init()
state = elastic.ObjectState(step=0, total=0, full=0)
me = os.environ["RING_WORKER_ID"]

def show(**fields):
    print(json.dumps({"worker": me, "ring": [hvd.rank(), hvd.size()], **fields}), flush=True)

@elastic.run
def train(state):
    show(start=state.step, env=[os.environ["RANK"], os.environ["WORLD_SIZE"]])
    while state.full < steps:
        state.total += int(hvd.allreduce(torch.ones(1), op=hvd.Sum, name="count").item())
        state.step += 1
        state.full += hvd.size() == want
        if state.step == die_at and me == "1" and not os.path.exists("died"):
            open("died", "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05)
        state.commit()

train(state)
show(final=[state.step, state.total])
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@pytest.fixture
def job(tmp_path):
    """The training script, and a discovery script that prints ``hosts.txt``."""
    (tmp_path / "train.py").write_text(_TRAIN)
    script = tmp_path / "discover.sh"
    script.write_text(f"#!/bin/sh\ncat {tmp_path / 'hosts.txt'}\n")
    script.chmod(0o755)
    return tmp_path


def _start(cwd, flags: list[str], *train_args: int) -> subprocess.Popen:
    argv = [sys.executable, "-m", "ringrun", *flags, "--host-discovery-script", "./discover.sh",
            sys.executable, "train.py", *map(str, train_args)]  # fmt: skip
    return subprocess.Popen(argv, cwd=cwd, env=_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _lines(proc: subprocess.Popen, until=None, timeout: float = 90) -> list[dict]:
    """The workers' JSON lines, until ``until(lines)`` or the end of ringrun's output."""
    out: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and (until is None or not until(out)):
        line = proc.stdout.readline()  # type: ignore[union-attr]
        if not line:
            break
        if "]<stdout>:{" in line:
            out.append(json.loads(line.split("]<stdout>:", 1)[1]))
    return out


def _finish(proc: subprocess.Popen) -> tuple[int, str]:
    try:
        return proc.wait(timeout=60), proc.stderr.read()  # type: ignore[union-attr]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_third_slot_listed_mid_run_starts_a_worker_that_joins_the_ring(job):
    (job / "hosts.txt").write_text("localhost:2\n")
    proc = _start(job, ["--min-np", "1", "--max-np", "3"], 10, 3)
    first = _lines(proc, until=lambda out: len(out) == 2)
    (job / "hosts.txt").write_text("localhost:3\n")  # the cluster grows
    rest = _lines(proc)
    code, err = _finish(proc)
    assert code == 0, err
    assert sorted(line["ring"] for line in first) == [[0, 2], [1, 2]]
    starts = [line for line in first + rest if "start" in line]
    for line in starts:  # each generation's torchrun variables are the ring's
        assert line["env"] == [str(line["ring"][0]), str(line["ring"][1])], line
    last = [line for line in starts if line["ring"][1] == 3]
    assert sorted(line["ring"][0] for line in last) == [0, 1, 2]
    assert {line["worker"] for line in last} == {"0", "1", "2"}
    finals = [line for line in rest if "final" in line]
    assert len(finals) == 3 and len({tuple(line["final"]) for line in finals}) == 1, finals
    steps, total = finals[0]["final"]
    assert total == 2 * (steps - 10) + 3 * 10  # 2 per step in the first ring, 3 after
    assert "worker 2 on localhost starts and joins the ring" in err


@pytest.mark.reliability(fault="a worker of an elastic ringrun job is killed", category="fault")
def test_a_killed_worker_is_dropped_and_the_others_finish_from_the_last_commit(request, job):
    (job / "hosts.txt").write_text("localhost:3\n")
    started = time.monotonic()
    proc = _start(job, ["--min-np", "1"], 20, 2, 6)
    lines = _lines(proc)
    code, err = _finish(proc)
    assert code == 0, err
    assert "worker 1 on localhost was ended by signal 9; the ring re-forms without it" in err
    finals = [line for line in lines if "final" in line]
    assert sorted(line["worker"] for line in finals) == ["0", "2"]
    assert sorted(line["ring"] for line in finals) == [[0, 2], [1, 2]]
    assert len({tuple(line["final"]) for line in finals}) == 1, finals
    steps, total = finals[0]["final"]
    # the ring of 3 committed step 6 (or only step 5, had a survivor's allreduce failed)
    assert total in (3 * 6 + 2 * (steps - 6), 3 * 5 + 2 * (steps - 5)), finals
    record(request, detect_s=time.monotonic() - started)


@pytest.mark.reliability(
    fault="an elastic ringrun job below --min-np for longer than --elastic-timeout",
    category="fault",
)
def test_below_min_np_for_longer_than_the_elastic_timeout_fails_the_job_saying_why(job):
    (job / "hosts.txt").write_text("localhost:2\n")
    proc = _start(job, ["--min-np", "2", "--elastic-timeout", "2"], 1000, 2, 3)
    _lines(proc)
    code, err = _finish(proc)
    assert code == 1, err
    assert "only 1 workers left, fewer than --min-np=2, for longer than" in err
    assert "lower --min-np" in err


def _script(tmp_path, name: str, mode: int) -> str:
    path = tmp_path / name
    path.write_text("#!/bin/sh\necho localhost:2\n")
    path.chmod(mode)
    return str(path)


@pytest.mark.reliability(fault="bad elastic ringrun command lines", category="bad-input", cases=7)
def test_bad_elastic_flags_are_refused_naming_the_value_before_any_worker_starts(tmp_path, capsys):
    good = _script(tmp_path, "hosts.sh", 0o755)
    bad = [
        (["--min-np", "3", "--max-np", "2", "--host-discovery-script", good],
         "--max-np must be unset or an integer >= --min-np=3, got 2"),
        (["--min-np", "0", "--host-discovery-script", good], "--min-np must be an integer >= 1, got 0"),
        (["--min-np", "1", "--host-discovery-script", str(tmp_path / "nope.sh")],
         "nope.sh' does not exist; give the path of an executable script"),
        (["--min-np", "1", "--host-discovery-script", _script(tmp_path, "plain.sh", 0o644)],
         "plain.sh' is not executable; chmod +x"),
        (["--min-np", "1", "--host-discovery-script", good, "--spark"], "drop --spark"),
        (["--min-np", "1", "--host-discovery-script", good, "--slots-per-host", "0"],
         "--slots-per-host 0: a host has >= 1 slot"),
        (["-np", "2", "--reset-limit", "1"], "--reset-limit 1 is for elastic jobs"),
    ]  # fmt: skip
    marker = tmp_path / "started"
    command = [sys.executable, "-c", f"open({str(marker)!r}, 'w')"]
    for args, message in bad:
        assert ringrun.main([*args, *command]) == 2, args
        err = capsys.readouterr().err
        assert message in err, (args, err)
    assert not marker.exists()


def test_discovery_lines_are_host_slots_or_a_host_with_slots_per_host():
    assert parse_hosts("a:4\n\nb\na:2\n", 1, "d.sh") == [("b", 1), ("a", 2)]
    with pytest.raises(DiscoveryError, match="printed 'b' without slots; print host:slots"):
        parse_hosts("a:4\nb\n", None, "d.sh")
    with pytest.raises(DiscoveryError, match="printed 'a:x'"):
        parse_hosts("a:x\n", None, "d.sh")
