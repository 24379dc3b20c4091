"""ray_runner on a cluster started with ``ray start --head`` (127.0.0.1, its own temp
dir), joined by address. (A Ray Client ``ray://`` test is not here yet: the head's
client server failed to start in this sandbox, see docs/status.md.)

The fixture starts ``ray start --head --block`` and at the end kills exactly the
processes it started (that command and its descendants, by PID) — never ``ray stop``,
which would end every Ray instance on the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")


from ray_runner import RayExecutor  # noqa: E402

pytestmark = pytest.mark.ray


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"ray start exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(f"nothing listened on 127.0.0.1:{port} within {timeout_s} s")


def _end(proc: subprocess.Popen) -> None:
    """Kill the ``ray start`` process and every process below it, by PID."""
    try:
        tree = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        tree = []
    for p in [psutil.Process(proc.pid), *tree] if proc.poll() is None else tree:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(tree, timeout=10)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


@pytest.fixture(scope="session")
def head_node():
    """``ray start --head`` on 127.0.0.1 with 2 CPUs; (gcs address, ray:// address)."""
    if ray.is_initialized():
        ray.shutdown()
    gcs_port, client_port = _free_port(), _free_port()
    temp_dir = tempfile.mkdtemp(prefix="ringray_")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [
        ray_bin, "start", "--head", "--block",
        f"--port={gcs_port}", f"--ray-client-server-port={client_port}",
        "--node-ip-address=127.0.0.1", "--include-dashboard=false",
        "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]  # fmt: skip
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_for_port(client_port, proc, 120)
        yield f"127.0.0.1:{gcs_port}", f"ray://127.0.0.1:{client_port}"
    finally:
        _end(proc)


def _where():
    import ringcore.torch as hvd

    hvd.init()
    return hvd.rank(), hvd.size(), hvd.local_rank()


@pytest.fixture
def by_value():
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


@pytest.mark.timeout(120)
def test_executor_joins_a_ray_start_cluster_by_address(head_node, by_value):
    from test_ray_cluster import loopback_only

    with loopback_only():
        ray.init(address=head_node[0])
        assert ray.cluster_resources().get("CPU") == 2.0
        with RayExecutor(num_workers=2, placement_group_timeout_s=60) as ex:
            assert ex.run(_where) == [(0, 2, 0), (1, 2, 1)]
