"""Rings across hosts: network namespaces on one bridge (see ``tests/_netns.py``).

Each host's hostname resolves to 127.0.0.1 — as on many real clusters — and nothing
sets ``GLOO_SOCKET_IFNAME``: ringcore must bind the data plane to the interface on the
route to the store, and the runners must number the ranks host by host. Skipped where
root or ``ip netns`` is missing.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
import time

import pytest
from _multihost import (
    SHORT_TIMEOUTS,
    clean_env,
    ip_link,
    rank_results,
    ray_on_two_hosts,
    run_ranks,
    two_hosts,
)
from _netns import kill_tree, python_stacks, unavailable
from _reliability import record

_WHY = unavailable()
pytestmark = [
    pytest.mark.skipif(_WHY is not None, reason=_WHY or ""),
    pytest.mark.timeout(180),
]


@pytest.fixture(scope="module")
def cluster():
    yield from two_hosts()


_TF_COLLECTIVES = """
import json, os
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
import tensorflow as tf
import ringcore.tensorflow as hvd

hvd.init()
total = hvd.allreduce(tf.constant([float(hvd.rank() + 1)]), op=hvd.Sum)
gathered = hvd.allgather(tf.constant([hvd.rank()]))
graph_sum = tf.function(lambda: hvd.allreduce(tf.ones([3]) * hvd.rank(), op=hvd.Sum))()
print(json.dumps({
    "rank": hvd.rank(), "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(),
    "sum": float(total.numpy()[0]), "gathered": gathered.numpy().tolist(),
    "graph_sum": graph_sum.numpy().tolist(),
}), flush=True)
hvd.shutdown()
"""


def test_collectives_across_two_hosts_need_no_gloo_socket_ifname(cluster):
    started = time.monotonic()
    results = rank_results(run_ranks(cluster, per_host=2, extra={}))
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["sum"] == 10.0 for r in results)
    assert all(r["gathered"] == [0, 1, 2, 3] for r in results)
    # host-major: ranks of one host consecutive, Horovod's local and cross ranks
    for r in results:
        assert (r["local_size"], r["cross_size"]) == (2, 2)
        assert r["cross_rank"] == r["rank"] // r["local_size"]
        assert r["local_rank"] == r["rank"] % r["local_size"]
        assert r["gloo_iface"] == "eth0"  # the interface on the route to the store
    assert results[0]["hostname"] != results[2]["hostname"]
    assert time.monotonic() - started < 90


def test_tensorflow_collectives_across_two_hosts_eager_and_in_a_graph(cluster):
    pytest.importorskip("tensorflow")
    results = rank_results(run_ranks(cluster, per_host=2, extra={}, script=_TF_COLLECTIVES))
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    for r in results:
        assert r["sum"] == 10.0 and r["gathered"] == [0, 1, 2, 3]
        assert r["graph_sum"] == [6.0, 6.0, 6.0]
        assert r["local_size"] == 2 and r["cross_rank"] == r["rank"] // 2


_MPI_JOB = """
import json, sys, torch
import ringcore.torch as hvd
hvd.init()
r = hvd.rank()
out = {"rank": r, "size": hvd.size(), "local_rank": hvd.local_rank(),
       "local_size": hvd.local_size(), "cross_rank": hvd.cross_rank(), "mpi": hvd.mpi_enabled(),
       "sum": hvd.allreduce(torch.tensor([r + 1.0]), op=hvd.Sum).item(),
       "gather": hvd.allgather(torch.tensor([r])).tolist()}
hvd.shutdown()
with open(f"{sys.argv[1]}/result.{r}.json", "w") as f:  # files: mpirun interleaves output
    json.dump(out, f)
"""

# Hydra's ssh launcher, with "ssh" replaced by this: the host (its address) is mapped
# to its namespace, and the proxy runs there under the host's own hostname.
_MPI_LAUNCHER = """#!/bin/sh
while [ "${1#-}" != "$1" ]; do shift; done
host="$1"; shift
line=$(grep "^$host " "$(dirname "$0")/hosts")
ns=${line#* }; ns=${ns% *}; name=${line##* }
cmd=$(echo "$*" | sed 's/--iface [^ ]*//')
exec ip netns exec "$ns" unshare --uts -- sh -c "hostname $name && $cmd"
"""


def test_mpirun_across_two_hosts_runs_the_mpi_backend_without_a_hand_setting(cluster, tmp_path):
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    if not os.path.exists(mpiexec):
        pytest.skip("mpiexec is not installed (pip install 'ringtrain[mpi]')")
    launcher = tmp_path / "launch.sh"
    launcher.write_text(_MPI_LAUNCHER)
    launcher.chmod(0o755)
    (tmp_path / "hosts").write_text(
        "".join(f"{h.addr} {h.ns} {h.hostname}\n" for h in cluster.hosts)
    )
    (tmp_path / "job.py").write_text(_MPI_JOB)
    hosts = ",".join(f"{h.addr}:2" for h in cluster.hosts)
    proc = subprocess.run(
        [mpiexec, "-launcher", "ssh", "-launcher-exec", str(launcher),
         "-iface", cluster.bridge, "-hosts", hosts, "-n", "4",
         sys.executable, str(tmp_path / "job.py"), str(tmp_path)],
        env=clean_env(), capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result.{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["size"] == 4 and r["mpi"] is True
        assert r["sum"] == 10.0 and r["gather"] == [0, 1, 2, 3]
        assert (r["local_size"], r["cross_rank"]) == (2, r["rank"] // 2)


def test_a_store_named_by_a_hostname_that_is_loopback_on_its_own_host_still_works(cluster):
    """RING_STORE_ADDR = rank 0's hostname: 127.0.0.1 on its own host, its address on
    the other (as /etc/hosts and DNS often say). Rank 0's ring must not go onto lo."""
    runs = run_ranks(cluster, per_host=1, extra={}, store=cluster.hosts[0].hostname)
    results = rank_results(runs)
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert [r["gloo_iface"] for r in results] == ["eth0", "eth0"]


_TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _ring_with_placement():

    import torch
    from pyspark import BarrierTaskContext

    import ringcore.torch as hvd

    sys.path.insert(0, _TESTS)  # the hosts share this file system
    import _torch_programs

    ddp = _torch_programs.run_all(["ddp"])["ddp"]  # a torchrun program: its own group, then ours
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return {
        "rank": hvd.rank(),
        "local_rank": hvd.local_rank(),
        "local_size": hvd.local_size(),
        "cross_rank": hvd.cross_rank(),
        "cross_size": hvd.cross_size(),
        "sum": total,
        "partition": BarrierTaskContext.get().partitionId(),
        "hostname": socket.gethostname(),
        "gloo_iface": os.environ.get("GLOO_SOCKET_IFNAME"),
        "ddp": ddp,
    }


@pytest.fixture(scope="module")
def spark_on_two_hosts(cluster, tmp_path_factory):
    """A standalone master on the bridge, one 2-core worker on each namespace host."""
    import pyspark

    import spark_runner

    home = os.path.dirname(pyspark.__file__)
    work = tmp_path_factory.mktemp("spark-multihost")
    spark_class = os.path.join(home, "bin", "spark-class")
    port = random.randint(40001, 50000)
    master_url = f"spark://{cluster.bridge_addr}:{port}"
    procs: list[subprocess.Popen] = []

    def start(args: list[str], local_ip: str, log: str, host=None) -> subprocess.Popen:
        env = {**clean_env(), "SPARK_HOME": home, "SPARK_LOCAL_IP": local_ip}
        env["PYSPARK_PYTHON"] = sys.executable
        cmd = [spark_class, *args]
        with open(work / log, "wb") as out:
            proc = subprocess.Popen(
                host.wrap(cmd) if host else cmd,
                env=env,
                stdout=out,
                stderr=out,
                start_new_session=True,
            )
        procs.append(proc)
        return proc

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in work.glob("*.log"))

    try:
        start(
            ["org.apache.spark.deploy.master.Master", "--host", cluster.bridge_addr,
             "--port", str(port), "--webui-port", "0"],
            cluster.bridge_addr, "master.log",
        )  # fmt: skip
        for i, host in enumerate(cluster.hosts):
            start(
                ["org.apache.spark.deploy.worker.Worker", master_url, "--host", host.addr,
                 "--cores", "2", "--memory", "1g", "--webui-port", "0",
                 "--work-dir", str(work / f"worker{i}")],
                host.addr, f"worker{i}.log", host,
            )  # fmt: skip
        session = spark_runner.local_session(
            master_url,
            app_name="test_multihost",
            conf={
                "spark.executor.cores": "2",
                "spark.executor.memory": "512m",
                "spark.driver.host": cluster.bridge_addr,
                "spark.driver.bindAddress": cluster.bridge_addr,
            },
        )
        try:
            yield session, logs
        finally:
            session.stop()
    finally:
        for proc in reversed(procs):
            kill_tree(proc)


@pytest.mark.spark
@pytest.mark.slow
def test_spark_run_across_two_hosts_numbers_ranks_host_by_host(cluster, spark_on_two_hosts):
    import io

    import spark_runner

    _, logs = spark_on_two_hosts
    started = time.monotonic()
    try:
        results = spark_runner.run(
            _ring_with_placement, num_proc=4, start_timeout=90, stdout=io.StringIO()
        )
    except Exception as exc:
        raise AssertionError(f"{exc}\n{logs()}") from exc
    # (rank, Spark partition, host): what the barrier stage placed where (-s shows it)
    print([(r["rank"], r["partition"], r["hostname"]) for r in results])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["sum"] == 10.0 for r in results)
    hostnames = [r["hostname"] for r in results]
    assert hostnames[0] == hostnames[1] != hostnames[2] == hostnames[3]
    for r in results:
        assert (r["local_size"], r["cross_size"]) == (2, 2)
        assert r["cross_rank"] == r["rank"] // r["local_size"]
        assert r["local_rank"] == r["rank"] % r["local_size"]
        assert r["gloo_iface"] == "eth0"
        assert (r["ddp"]["rank"], r["ddp"]["world_size"]) == (r["rank"], 4)
    assert len({r["ddp"]["digest"] for r in results}) == 1  # DDP across the hosts, in step
    assert time.monotonic() - started < 90


def _elastic_ring_with_placement():

    import torch

    import ringcore.torch as hvd
    from ringcore.torch import elastic

    hvd.init()
    state = elastic.ObjectState(steps=0)

    @elastic.run
    def train(state):
        total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
        state.steps += 1
        state.commit()
        return {
            "rank": hvd.rank(),
            "local_rank": hvd.local_rank(),
            "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(),
            "cross_size": hvd.cross_size(),
            "sum": total,
            "hostname": socket.gethostname(),
        }

    return train(state)


@pytest.mark.spark
@pytest.mark.slow
def test_run_elastic_across_two_hosts_numbers_ranks_host_by_host(cluster, spark_on_two_hosts):
    import io

    import spark_runner

    _, logs = spark_on_two_hosts
    try:
        results = spark_runner.run_elastic(
            _elastic_ring_with_placement, num_proc=4, start_timeout=90, stdout=io.StringIO()
        )
    except Exception as exc:
        raise AssertionError(f"{exc}\n{logs()}") from exc
    print([(r["rank"], r["hostname"]) for r in results])
    assert [r["rank"] for r in results] == [0, 1, 2, 3]
    assert all(r["sum"] == 10.0 for r in results)
    hostnames = [r["hostname"] for r in results]
    assert hostnames[0] == hostnames[1] != hostnames[2] == hostnames[3]
    for r in results:
        assert (r["local_size"], r["cross_size"]) == (2, 2)
        assert r["cross_rank"] == r["rank"] // r["local_size"]
        assert r["local_rank"] == r["rank"] % r["local_size"]


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.parametrize("url", [False, True], ids=["path", "fsspec-url"])
def test_ring_estimator_fits_and_transforms_across_two_hosts(
    cluster, spark_on_two_hosts, tmp_path, url
):
    from _digits import demo

    from estimators import Store

    spark, logs = spark_on_two_hosts
    # a directory every host sees (the namespaces share the file system, as an NFS
    # mount or a FUSE volume would), as a path and as an fsspec URL
    store = Store.create(("file://" if url else "") + str(tmp_path / "store"))
    estimator = demo.make_estimator(store, epochs=3).setNumProc(4)  # 2 slots per host
    if url:  # FSDP2 across the hosts: each rank's shard written where every host sees it
        estimator.setStrategy("fsdp")
    train_df, test_df = demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)
    try:
        model = estimator.fit(train_df)
        accuracy = demo.held_out_accuracy(model, test_df)
    except Exception as exc:
        raise AssertionError(f"{exc}\n{logs()}") from exc
    assert len(model.getHistory()) == 3
    assert accuracy >= 0.6, model.getHistory()
    if url:  # the last epoch's folder (<fit>-<attempt>-<epoch>) holds one shard per rank
        folders = (tmp_path / "store").glob("runs/*/sharded/*")
        last = max(folders, key=lambda f: int(f.name.rsplit("-", 1)[1]))
        shards = sorted(p.name for p in last.glob("*.distcp"))
        assert shards == [f"__{r}_0.distcp" for r in range(4)], shards


_RAY_DRIVER = """
import json, os, sys, time
import ray
from ray_runner import RayExecutor

ray.init(address=sys.argv[1], _node_ip_address=sys.argv[2])  # not the hostname's 127.0.0.1
deadline = time.monotonic() + 60
while sum(n["Alive"] for n in ray.nodes()) < 2:
    assert time.monotonic() < deadline, ray.nodes()
    time.sleep(0.5)

def where():
    import os, torch
    import ringcore.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return {"rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
            "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(), "sum": total,
            "ip": ray.util.get_node_ip_address(),
            "gloo_iface": os.environ.get("GLOO_SOCKET_IFNAME")}

executor = RayExecutor(num_workers=4, cpus_per_worker=1)
executor.start()
try:
    print("RESULT", json.dumps(executor.run(where)), flush=True)
finally:
    executor.shutdown()

from ray_runner import RingTrainer, RunConfig, ScalingConfig

def loop(config):
    import ringcore.torch as hvd
    import ray_runner
    from ringcore.torch import elastic
    hvd.init()
    state = elastic.ObjectState(steps=0)

    @elastic.run
    def train(state):
        everyone = hvd.allgather_object(where())
        state.steps += 1
        state.commit()
        ray_runner.report({"ranks": everyone})

    if config["elastic"]:
        train(state)
    else:
        ray_runner.report({"ranks": hvd.allgather_object(where())})

for elastic_run in (False, True):
    workers = (2, 4) if elastic_run else 4
    trainer = RingTrainer(
        loop, train_loop_config={"elastic": elastic_run},
        scaling_config=ScalingConfig(num_workers=workers),
        run_config=RunConfig(name=f"multihost-{elastic_run}", storage_path=sys.argv[3]),
    )
    print("RESULT", json.dumps(trainer.fit().metrics["ranks"]), flush=True)
"""


@pytest.mark.ray
@pytest.mark.slow
def test_ray_executor_and_ring_trainer_across_two_hosts_number_ranks_host_by_host(
    cluster, tmp_path
):
    pytest.importorskip("ray")
    head, other = cluster.hosts
    with ray_on_two_hosts(cluster, tmp_path) as (gcs, env, ray_logs):
        driver = subprocess.run(
            head.wrap([sys.executable, "-c", _RAY_DRIVER, gcs, head.addr, str(tmp_path / "runs")]),
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    logs = ray_logs()
    assert driver.returncode == 0, driver.stderr[-4000:] + logs
    # RayExecutor.run, then RingTrainer.fit fixed (4 workers) and elastic (2 to 4)
    lines = driver.stdout.splitlines()
    runs = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("RESULT ")]
    assert len(runs) == 3, driver.stdout[-4000:]
    for results in runs:
        assert [r["rank"] for r in results] == [0, 1, 2, 3]
        ips = [r["ip"] for r in results]
        assert ips[0] == ips[1] != ips[2] == ips[3]
        assert set(ips) == {head.addr, other.addr}
        for r in results:
            assert (r["local_size"], r["cross_size"]) == (2, 2)
            assert r["cross_rank"] == r["rank"] // r["local_size"]
            assert r["gloo_iface"] == "eth0"
    assert all(r["sum"] == 10.0 for r in runs[0])


def _elastic_steps_until_done(total_steps):
    import time

    import torch

    import ringcore.torch as hvd
    from ringcore.torch import elastic

    hvd.init()
    state = elastic.ObjectState(step=0, sizes=[])

    @elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        while state.step < total_steps:
            hvd.allreduce(torch.ones(256), op=hvd.Sum, name="grad")
            state.step += 1
            if state.step == 10 and hvd.rank() == 0:
                print("READY", flush=True)
            state.commit()
            time.sleep(0.05)
        return {"sizes": state.sizes, "rank": hvd.rank(), "size": hvd.size()}

    return train(state)


class _Watch:
    """run_elastic's stdout: calls ``on_ready`` once when a worker prints READY."""

    def __init__(self, on_ready):
        self.on_ready, self.fired, self.text = on_ready, False, []

    def write(self, text):
        self.text.append(text)
        if "READY" in text and not self.fired:
            self.fired = True
            self.on_ready()

    def flush(self):
        pass


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.reliability(
    fault="a host partitioned from an elastic job (run_elastic)", category="fault"
)
def test_run_elastic_goes_on_without_a_partitioned_host(
    cluster, spark_on_two_hosts, monkeypatch, request
):
    import spark_runner

    _, logs = spark_on_two_hosts
    monkeypatch.setenv("RING_CONTROL_TIMEOUT_SECONDS", "8")  # the driver's log server
    cut_at: list[float] = []

    def cut():
        cut_at.append(time.monotonic())
        ip_link(cluster, 1, "down")

    watch = _Watch(cut)
    try:
        results = spark_runner.run_elastic(
            _elastic_steps_until_done,
            args=(400,),
            num_proc=4,
            min_num_proc=2,
            start_timeout=90,
            env={**SHORT_TIMEOUTS, "RING_START_TIMEOUT": "20"},
            stdout=watch,
        )
        done = time.monotonic()
    except Exception as exc:
        raise AssertionError(f"{exc}\n{''.join(watch.text)[-3000:]}\n{logs()}") from exc
    finally:
        ip_link(cluster, 1, "up")
    assert cut_at, "no worker reported READY"
    print([(r["rank"], r["sizes"]) for r in results], f"{done - cut_at[0]:.1f} s after the cut")
    assert [r["size"] for r in results] == [2, 2]
    assert all(r["sizes"][0] == 4 and r["sizes"][-1] == 2 for r in results)
    record(request, recover_s=done - cut_at[0], note="control and Gloo timeouts 8 s")


def test_a_hung_tests_report_holds_the_python_stacks_of_the_processes_it_names(tmp_path):
    """The diagnostics the elastic Ray test prints when a fit hangs: py-spy's dump of
    every process below a root whose command line starts with the given prefix."""
    script = tmp_path / "sleeper_for_stacks.py"
    script.write_text("import time\ndef waits_here():\n    time.sleep(60)\nwaits_here()\n")
    parent = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys; subprocess.run(sys.argv[1:])",
         sys.executable, str(script)],
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        stacks = ""
        while "waits_here" not in stacks and time.monotonic() < deadline:
            time.sleep(0.5)
            stacks = python_stacks(parent.pid, sys.executable.encode())
        assert "waits_here" in stacks and "sleeper_for_stacks.py" in stacks, stacks
        assert python_stacks(parent.pid, b"no such process title") == ""
    finally:
        kill_tree(parent)


_RINGRUN_JOB = """
import json, os, socket, torch, torch.distributed as dist
import ringcore.torch as hvd
dist.init_process_group("gloo")  # env://: MASTER_ADDR/PORT, RANK, WORLD_SIZE from ringrun
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
# the backend "ring", known under ringrun: DDP over it across the hosts, as over Gloo
ring = dist.new_group(backend="ring")
weights = []
for group in (ring, None):
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 4), process_group=group)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    for _ in range(3):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    weights.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
hvd.init()
print(json.dumps({
    "rank": hvd.rank(), "local_rank": hvd.local_rank(), "cross_rank": hvd.cross_rank(),
    "dist_sum": t.item(), "sum": hvd.allreduce(torch.tensor([1.0]), op=hvd.Sum).item(),
    "hostname": socket.gethostname(), "master": os.environ["MASTER_ADDR"],
    "ring": ring.reason, "ring_ops": ring.stats["shm"],
    "ddp_diff": float((weights[0] - weights[1]).abs().max()),
}), flush=True)
hvd.shutdown()
"""

# ssh's place for ringrun: ssh's options dropped, the host mapped to its namespace, the
# remote line run there under the host's own hostname (as _MPI_LAUNCHER does for mpiexec)
_RINGRUN_SSH = """#!/bin/sh
while [ $# -gt 0 ]; do case "$1" in -o|-p|-i) shift 2;; -*) shift;; *) break;; esac; done
line=$(grep "^$1 " "$(dirname "$0")/hosts")
ns=${line#* }; ns=${ns% *}; name=${line##* }
exec ip netns exec "$ns" unshare --uts -- sh -c "hostname $name && $2"
"""


def test_ringrun_runs_two_ranks_on_each_of_two_hosts_through_ssh(cluster, tmp_path):
    """ringrun in the root namespace hosts the store (on its address toward the hosts);
    ranks start over the ssh seam; rank 0's MASTER_PORT is asked of its host; the
    program's own init_process_group() forms a group across the hosts with no setting,
    and a group of the backend "ring" runs DDP in two levels as Gloo runs it."""
    launcher = tmp_path / "ssh.sh"
    launcher.write_text(_RINGRUN_SSH)
    launcher.chmod(0o755)
    (tmp_path / "hosts").write_text(
        "".join(f"{h.addr} {h.ns} {h.hostname}\n" for h in cluster.hosts)
    )
    (tmp_path / "job.py").write_text(_RINGRUN_JOB)
    hosts = ",".join(f"{h.addr}:2" for h in cluster.hosts)
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "ringrun", "-np", "4", "-H", hosts, "--start-timeout", "40",
         sys.executable, str(tmp_path / "job.py")],
        # no GLOO_SOCKET_IFNAME: the hosts' names resolve to 127.0.0.1, and the program's
        # own Gloo group binds where ringcore's ring would (ringrun runs this interpreter's
        # scripts under the launchers' init guard); under torchrun it would need one
        env={**clean_env(), "RINGRUN_SSH": str(launcher)},
        cwd=tmp_path,
        capture_output=True, text=True, timeout=150,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        rank, _, text = line[1:].partition("]<stdout>:")
        if text.startswith("{"):
            results[int(rank)] = json.loads(text)
    assert sorted(results) == [0, 1, 2, 3]
    for r, res in results.items():
        assert res["rank"] == r and res["dist_sum"] == 10.0 and res["sum"] == 4.0
        assert (res["local_rank"], res["cross_rank"]) == (r % 2, r // 2)
        assert res["master"] == cluster.hosts[0].addr
        assert res["ring"] == "hierarchical: 2 hosts x 2 ranks, the hosts over Gloo"
        assert res["ring_ops"] > 3 and res["ddp_diff"] < 1e-6
    assert results[0]["hostname"] == results[1]["hostname"] != results[2]["hostname"]
    assert time.monotonic() - started < 120
