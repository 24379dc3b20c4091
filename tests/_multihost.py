"""What the multi-host tests share: two hosts as network namespaces on one bridge
(``tests/_netns.py``), ranks started as plain processes on them, a host's link cut, and
a Ray cluster over both. Used by tests/end_to_end/test_multihost.py (runners, the
estimator, ringrun, TensorFlow and MPI across hosts) and test_multihost_faults.py (a
wrong interface, hosts cut or lost).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from _netns import Cluster, kill_tree, python_stacks

from ringcore import topology_from_hosts, worker_env

COLLECTIVES = """
import json, socket
import torch
import ringcore.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum)
gathered = hvd.allgather(torch.tensor([hvd.rank()]))
print(json.dumps({
    "rank": hvd.rank(), "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
    "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
    "sum": total.item(), "gathered": gathered.tolist(), "hostname": socket.gethostname(),
    "gloo_iface": __import__("os").environ.get("GLOO_SOCKET_IFNAME"),
}), flush=True)
hvd.shutdown()
"""

IFACE_VARS = ("RING_IFACE", "HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def two_hosts() -> Iterator[Cluster]:
    """Two namespace hosts for as long as the caller (a module's fixture) holds them."""
    made = Cluster(2).up()
    try:
        yield made
    finally:
        made.down()


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    for var in IFACE_VARS:
        env.pop(var, None)
    env["PYTHONPATH"] = os.getcwd()
    return env


def start_rank(slots, rank: int, store_addr: str, port: int, script: str, extra) -> Any:
    """Rank ``rank`` of a ring over ``slots`` (a host per rank) as a plain subprocess on
    its host, with the ``RING_*`` environment and ``extra`` on top, but no
    ``RING_HOSTNAME``: ringcore must find the address itself."""
    topo = topology_from_hosts([h.addr for h in slots], rank)
    env = {**clean_env(), **worker_env(topo, store_addr, port), **extra}
    env.pop("RING_HOSTNAME", None)
    return subprocess.Popen(
        slots[rank].wrap([sys.executable, "-c", script]),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def run_ranks(
    cluster: Cluster,
    per_host: int,
    extra: dict[str, str],
    store: str = "",
    script: str = COLLECTIVES,
) -> list[tuple[int, str, str]]:
    """One plain subprocess per rank, ``per_host`` on each host, rank 0's host the store."""
    slots = [h for h in cluster.hosts for _ in range(per_host)]
    port = random.randint(20000, 40000)
    procs = []
    try:
        for rank in range(len(slots)):
            extra_env = {**extra, "RING_START_TIMEOUT": "40"}
            procs.append(start_rank(slots, rank, store or slots[0].addr, port, script, extra_env))
        outputs = [p.communicate(timeout=90) for p in procs]
    finally:
        for p in procs:
            kill_tree(p)
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outputs)]


def rank_results(runs: list[tuple[int, str, str]]) -> list[dict]:
    failed = [(rank, rc, err[-3000:]) for rank, (rc, _, err) in enumerate(runs) if rc]
    assert not failed, failed
    return [json.loads(out.strip().splitlines()[-1]) for _, out, _ in runs]


def ip_link(cluster, index: int, state: str) -> None:
    """The bridge side of host ``index``'s cable: "down" partitions it (no RST, nothing)."""
    subprocess.run(
        ["ip", "link", "set", f"rt{cluster.tag}v{index}", state], check=False, capture_output=True
    )


SHORT_TIMEOUTS = {"RING_GLOO_TIMEOUT_SECONDS": "8", "RING_CONTROL_TIMEOUT_SECONDS": "8"}


def wait_for(addr: str, port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        with socket.socket() as sock:
            if sock.connect_ex((addr, port)) == 0:
                return
        time.sleep(0.2)
    raise RuntimeError(f"nothing listens on {addr}:{port} after {timeout_s} s (exit {proc.poll()})")


@contextlib.contextmanager
def ray_on_two_hosts(cluster, tmp_path, extra_env: dict[str, str] | None = None):
    """A Ray head (2 CPUs, the GCS) on host 0 and a 2-CPU worker node on host 1, each a
    ``ray start --block`` under its host; yields (GCS address, the env to run a driver
    with, a function returning the nodes' log tails). ``extra_env`` reaches the raylets,
    the GCS and so every worker process Ray starts. Every process is ended on exit."""
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    head, other = cluster.hosts
    gcs = f"{head.addr}:{random.randint(50001, 60000)}"
    env = {**clean_env(), "GRPC_ENABLE_FORK_SUPPORT": "0", "RAY_USAGE_STATS_ENABLED": "0"}
    env.update(extra_env or {})
    common = ["--block", "--num-cpus=2", "--disable-usage-stats"]
    procs = []
    temp_dir = tempfile.mkdtemp(prefix="rtray")  # short: Ray's unix sockets live there
    try:
        for host, args in (
            (head, ["--head", f"--port={gcs.split(':')[1]}", "--include-dashboard=false",
                    f"--temp-dir={temp_dir}"]),
            (other, [f"--address={gcs}"]),
        ):  # fmt: skip
            with open(tmp_path / f"{host.ns}.log", "wb") as out:
                procs.append(
                    subprocess.Popen(
                        host.wrap([ray_bin, "start", f"--node-ip-address={host.addr}", *common, *args]),
                        env=env, stdout=out, stderr=out, start_new_session=True,
                    )
                )  # fmt: skip
            if host is head:
                wait_for(head.addr, int(gcs.split(":")[1]), procs[0], 60)

        def logs(workers: bool = False) -> str:
            """The nodes' log tails; ``workers``: the Ray workers' stderr tails and the
            ring workers' Python stacks too (read while the run is still there)."""
            paths = [*tmp_path.glob("*.log")]
            if workers:
                paths += sorted(Path(temp_dir).glob("session_*/logs/worker-*.err"))
            text = "\n".join(
                f"--- {p.name}\n{p.read_text(errors='replace')[-1500:]}" for p in paths
            )
            if workers:
                text += "\n" + "\n".join(
                    python_stacks(proc.pid, b"ray::RingWorker") for proc in procs
                )
            return text

        yield gcs, env, logs
    finally:
        for proc in reversed(procs):
            kill_tree(proc)
        shutil.rmtree(temp_dir, ignore_errors=True)
