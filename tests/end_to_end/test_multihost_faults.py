"""Faults across hosts (network namespaces on one bridge, ``tests/_multihost.py``): a
wrong interface, a host partitioned or lost under a ring, an elastic RingTrainer that
goes on without a partitioned host. Mostly waiting on timeouts; `make test` runs it, as
test_multihost.py, beside the main suite (the Makefile's HOUSE_TESTS). Skipped where
root or ``ip netns`` is missing.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
from _multihost import (
    SHORT_TIMEOUTS,
    ip_link,
    ray_on_two_hosts,
    run_ranks,
    start_rank,
    two_hosts,
)
from _netns import kill_tree, unavailable
from _reliability import record

_WHY = unavailable()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
    pytest.mark.timeout(180),
]


@pytest.fixture(scope="module")
def cluster():
    yield from two_hosts()


def test_a_wrong_interface_fails_on_every_rank_naming_the_store(cluster):
    """``RING_IFACE=lo`` on hosts that must talk over eth0: Gloo advertises 127.0.0.1,
    and every rank's error says which ring it could not form, through which store."""
    store = cluster.hosts[0].addr
    # every rank is in the store before Gloo connects, so a short timeout cannot fail a
    # ring that would have formed; Gloo's connectFullMesh takes about 5x it to give up
    extra = {"RING_IFACE": "lo", "RING_GLOO_TIMEOUT_SECONDS": "2"}
    runs = run_ranks(cluster, per_host=1, extra=extra)
    for rc, _, err in runs:
        assert rc != 0
        assert "could not form the gloo ring through " + store in err, err[-2000:]
    assert any("127.0.0.1" in err for _, _, err in runs)  # the address Gloo advertised


_LOOP_UNTIL_FAILURE = """
import json, sys, time
import torch
import ringcore.torch as hvd

hvd.init()
step = 0
try:
    while True:
        hvd.allreduce(torch.ones(1024), op=hvd.Sum, name="step")
        step += 1
        if step == 20:
            print("READY", flush=True)
        time.sleep(0.02)
except Exception as exc:
    print("FAILED", json.dumps({"rank": hvd.rank(), "type": type(exc).__name__,
                                "message": str(exc), "at": time.time(), "step": step}), flush=True)
    sys.exit(3)
"""


def _partition_and_time(cluster, cut, extra):
    """Two ranks, one per host, allreducing until ``cut(host)`` isolates or kills host 1;
    each survivor's (exit code, failure report, seconds from the cut to its failure)."""
    port = random.randint(20000, 40000)
    hosts = cluster.hosts
    procs = []
    try:
        for rank in range(len(hosts)):
            procs.append(start_rank(hosts, rank, hosts[0].addr, port, _LOOP_UNTIL_FAILURE, extra))
        for proc in procs:  # both in the loop
            line = proc.stdout.readline()
            assert line.startswith("READY"), (line, proc.stderr.read()[-3000:])
        cut_at = time.time()
        cut(hosts[1], procs[1])
        out, err = procs[0].communicate(timeout=120)
        done = time.time()
    finally:
        for p in procs:
            kill_tree(p)
        ip_link(cluster, 1, "up")
    reports = [
        json.loads(line.split(" ", 1)[1]) for line in out.splitlines() if line.startswith("FAILED ")
    ]
    assert reports, (procs[0].returncode, out[-2000:], err[-3000:])
    return procs[0].returncode, reports[0], done - cut_at


@pytest.mark.slow
@pytest.mark.reliability(
    fault="a host partitioned from the others (its link down)", category="fault"
)
def test_a_partitioned_host_fails_the_survivor_within_the_timeouts_naming_it(cluster, request):
    rc, report, seconds = _partition_and_time(
        cluster, lambda host, proc: ip_link(cluster, 1, "down"), SHORT_TIMEOUTS
    )
    print(f"partition: rank 0 failed {seconds:.1f} s after the cut: {report}")
    record(request, detect_s=seconds, note="RING_CONTROL_TIMEOUT_SECONDS=8, Gloo timeout 8 s")
    assert rc == 3 and report["rank"] == 0
    assert seconds < 30  # Gloo's 8 s or the control connection's 8 s, plus slack
    assert cluster.hosts[1].addr in report["message"] or "rank 1" in report["message"]


@pytest.mark.slow
@pytest.mark.reliability(fault="a host lost (every process on it killed)", category="fault")
def test_a_host_whose_processes_die_fails_the_survivor_at_once_naming_it(cluster, request):
    def kill_host(host, proc):
        kill_tree(proc, grace_s=0)

    rc, report, seconds = _partition_and_time(cluster, kill_host, {})
    print(f"host loss: rank 0 failed {seconds:.1f} s after the kill: {report}")
    record(request, detect_s=seconds)
    assert rc == 3 and report["rank"] == 0
    assert seconds < 10  # sockets closed by the dying host's kernel: no timeout involved
    assert cluster.hosts[1].addr in report["message"] or "rank 1" in report["message"]


# An elastic RingTrainer (2 to 4 workers) stepping with commits and a checkpoint every
# 5 steps; rank 0 reports every step's allreduce and, from step 10 on 4 ranks, writes READY.
_RAY_ELASTIC_DRIVER = """
import faulthandler, json, logging, os, signal, sys, time
import ray
faulthandler.register(signal.SIGUSR1)  # the test dumps the driver's stacks if it hangs
# the driver's membership decisions (workers lost, dropped, each generation) on stderr,
# which the test shows when the fit fails or hangs
logging.basicConfig(format="%(asctime)s %(name)s %(levelname)s %(message)s")
logging.getLogger("ringtrain").setLevel(logging.INFO)
from ray_runner import RingTrainer, RunConfig, ScalingConfig

ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2])
deadline = time.monotonic() + 60
while sum(n["Alive"] for n in ray.nodes()) < 2:
    assert time.monotonic() < deadline, ray.nodes()
    time.sleep(0.5)

def loop(config):
    import tempfile, time, torch
    import ray_runner
    import ringcore.torch as hvd
    from ringcore.torch import elastic
    hvd.init()
    state = elastic.ObjectState(step=0, sizes=[])

    @elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        while state.step < config["steps"]:
            total = hvd.allreduce(torch.tensor([state.step + 1.0]), op=hvd.Sum, name="s").item()
            state.step += 1
            if hvd.rank() == 0:
                checkpoint = None
                if state.step % 5 == 0:
                    folder = tempfile.mkdtemp()
                    with open(os.path.join(folder, "step"), "w") as f:
                        f.write(str(state.step))
                    checkpoint = ray_runner.Checkpoint.from_directory(folder)
                ray_runner.report({"step": state.step, "size": hvd.size(), "sum": total,
                                   "sizes": list(state.sizes), "at": time.time()},
                                  checkpoint=checkpoint)
                if hvd.size() == 4 and state.step >= 10 and not os.path.exists(config["ready"]):
                    open(config["ready"], "w").close()  # 4 ranks over both hosts
            state.commit()
            time.sleep(0.05)

    train(state)

trainer = RingTrainer(
    loop, train_loop_config={"steps": int(sys.argv[4]), "ready": sys.argv[5]},
    scaling_config=ScalingConfig(num_workers=(2, 4)),
    run_config=RunConfig(name="partitioned", storage_path=sys.argv[3], verbose=0),
)
result = trainer.fit()
print("DONE", time.time(), flush=True)
print("RESULT", json.dumps({"history": result.metrics_history,
                            "checkpoint": result.checkpoint and result.checkpoint.path}), flush=True)
"""

# Ray's node-death detection short: the GCS pings each raylet every second and declares
# it dead after 3 pings unanswered for a second each (defaults 3 s, 10 s and 5).
_RAY_SHORT_HEALTH_CHECK = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


@pytest.mark.ray
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.reliability(
    fault="a host partitioned from an elastic RingTrainer (Ray)", category="fault"
)
def test_elastic_ring_trainer_goes_on_without_a_partitioned_host(cluster, tmp_path, request):
    pytest.importorskip("ray")
    head = cluster.hosts[0]
    steps, ready = 120, tmp_path / "READY"
    extra = {**_RAY_SHORT_HEALTH_CHECK, **SHORT_TIMEOUTS}  # the workers inherit the raylets'
    cut_at = done_at = 0.0
    with ray_on_two_hosts(cluster, tmp_path, extra) as (gcs, env, ray_logs):
        args = [gcs, head.addr, str(tmp_path / "runs"), str(steps), str(ready)]
        driver = subprocess.Popen(
            head.wrap([sys.executable, "-c", _RAY_ELASTIC_DRIVER, *args]),
            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            start_new_session=True,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 150
            while not ready.exists() and driver.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            if ready.exists():
                cut_at = time.time()
                ip_link(cluster, 1, "down")
            try:
                out, err = driver.communicate(timeout=150)
            except subprocess.TimeoutExpired:
                workers = ray_logs(workers=True)  # while the driver still holds its actors
                os.kill(driver.pid, signal.SIGUSR1)  # the driver's stacks to its stderr
                time.sleep(1)
                kill_tree(driver)
                out, err = driver.communicate()
                pytest.fail(  # the driver's stderr (with its stacks) last: CI shows the tail
                    f"the fit did not end 150 s after the cut\n{workers}\n--- driver stdout\n"
                    f"{out[-3000:]}\n--- driver stderr\n{err[-16000:]}"
                )
            done_at = time.time()
        finally:
            kill_tree(driver)
            ip_link(cluster, 1, "up")
    logs = ray_logs()
    assert cut_at, (
        f"no READY before the driver ended (exit {driver.returncode})\n{err[-4000:]}{logs}"
    )
    assert driver.returncode == 0, out[-2000:] + err[-4000:] + logs
    lines = out.splitlines()
    (run,) = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("RESULT ")]
    (fit_done,) = [float(line.split()[1]) for line in lines if line.startswith("DONE ")]
    history = run["history"]
    # every step's allreduce right for the ring it ran on (size * (step)), each step
    # reported (a step redone after a restore may be reported twice), 4 ranks then 2
    assert all(m["sum"] == m["size"] * m["step"] for m in history), history
    assert sorted({m["step"] for m in history}) == list(range(1, steps + 1))
    # the ring may start with host 0's 2 and grow to 4 once host 1's are up
    sizes = history[-1]["sizes"]
    assert 4 in sizes and sizes[-1] == 2 and history[-1]["size"] == 2, sizes
    with open(os.path.join(run["checkpoint"], "step")) as f:
        assert f.read() == str(steps)  # the latest checkpoint is the last step's
    last_of_4 = max(i for i, m in enumerate(history) if m["size"] == 4)
    going_on = history[last_of_4 + 1]  # the first step of the 2 ranks left
    recover_s = going_on["at"] - cut_at
    print(
        f"sizes {sizes}; 2 ranks from step {going_on['step']}, {recover_s:.1f} s after the "
        f"cut; fit done {fit_done - cut_at:.1f} s after the cut"
    )
    record(
        request,
        recover_s=recover_s,
        note=f"seconds from the cut to the first step of the 2 ranks left (fit() done after "
        f"{fit_done - cut_at:.0f} s); Gloo and control timeouts 8 s, Ray health check 1 s x 3",
    )
    assert done_at - cut_at < 120
