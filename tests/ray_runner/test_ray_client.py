"""ray_runner on a cluster started with ``ray start --head`` (127.0.0.1, its own temp
dir), joined by address and through Ray Client (``ray.init("ray://127.0.0.1:PORT")``).

The fixture starts ``ray start --head --block`` and at the end kills exactly the
processes it started (that command and its descendants, by PID) — never ``ray stop``,
which would end every Ray instance on the machine.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile

import pytest

ray = pytest.importorskip("ray")
psutil = pytest.importorskip("psutil")


from _servers import free_port, wait_for_port  # noqa: E402

from ray_runner import (  # noqa: E402
    CheckpointConfig,
    FailureConfig,
    RayExecutor,
    RingTrainer,
    RunConfig,
    ScalingConfig,
)
from ringcore import RingError, WorkerError  # noqa: E402

pytestmark = pytest.mark.ray


def _client_server_log(temp_dir: str) -> str:
    """The tail of the head's client server logs, for a fixture that could not start."""
    logs = os.path.join(temp_dir, "session_latest", "logs")
    parts = []
    for name in ("ray_client_server.err", "ray_client_server.out", "ray_client_server.log"):
        with contextlib.suppress(OSError), open(os.path.join(logs, name)) as fh:
            parts.append(f"--- {name}\n" + "".join(fh.readlines()[-20:]))
    return "\n".join(parts) or f"(no client server log under {logs})"


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
    gcs_port, client_port = free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="ringray_")
    ray_bin = os.path.join(os.path.dirname(sys.executable), "ray")
    cmd = [
        ray_bin, "start", "--head", "--block",
        f"--port={gcs_port}", f"--ray-client-server-port={client_port}",
        "--node-ip-address=127.0.0.1", "--include-dashboard=false",
        "--num-cpus=2", f"--temp-dir={temp_dir}", "--disable-usage-stats",
    ]  # fmt: skip
    # The head's Ray Client proxy starts one "specific server" process per client
    # connection, forking while its gRPC threads run. With gRPC's fork support on (Ray's
    # default), that child sometimes died at once here (the proxy's log: "Other threads
    # are currently calling into gRPC, skipping fork() handlers", then "SpecificServer
    # startup failed"; the client: ConnectionAbortedError "Starting Ray client server
    # failed"): 1 connection in 3 to 6. GRPC_ENABLE_FORK_SUPPORT=0 for the head stops it.
    env = {**os.environ, "GRPC_ENABLE_FORK_SUPPORT": "0"}
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env
    )
    try:
        wait_for_port(client_port, proc, 120, "ray start", lambda: _client_server_log(temp_dir))
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


# ------------------------------------------------------------------ Ray Client (ray://)


def _sum_of_ranks(scale, *, offset):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    return hvd.rank(), hvd.size(), hvd.local_rank(), total * scale + offset


def _fails_on_rank_one():
    import ringcore

    ringcore.init()
    if ringcore.rank() == 1:
        raise LookupError("no shard for rank 1")
    return "fine"


def _checkpointed_loop(config):
    import tempfile as tmp

    import torch

    import ray_runner
    import ringcore.torch as hvd

    hvd.init()
    restored = ray_runner.get_checkpoint()
    start = 0
    if restored is not None:
        with restored.as_directory() as path, open(os.path.join(path, "it")) as fh:
            start = int(fh.read()) + 1
    for it in range(start, 3):
        total = hvd.allreduce(torch.tensor([float(it)]), op=hvd.Sum).item()
        with tmp.TemporaryDirectory() as path:
            with open(os.path.join(path, "it"), "w") as fh:
                fh.write(str(it))
            ray_runner.report(
                {"iteration": it, "sum": total, "start": start},
                checkpoint=ray_runner.Checkpoint.from_directory(path),
            )
        hvd.barrier()
        if it == 1 and hvd.rank() == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            raise RuntimeError("the first attempt fails on rank 1")


@pytest.fixture(scope="module")
def client(head_node):
    """This process as a Ray Client driver of the head node, one connection for the module."""
    if ray.is_initialized():
        ray.shutdown()
    ray.init(head_node[1])
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    try:
        assert ray.util.client.ray.is_connected()
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


@pytest.mark.timeout(120)
def test_executor_over_ray_client_returns_results_in_rank_order_and_worker_errors(client):
    with RayExecutor(num_workers=2, placement_group_timeout_s=60) as ex:
        assert ex.run(_sum_of_ranks, args=(2.0,), kwargs={"offset": 1.0}) == [
            (0, 2, 0, 7.0),
            (1, 2, 1, 7.0),
        ]
        assert ex.execute_single(lambda _: "rank 0 only") == "rank 0 only"
        with pytest.raises(WorkerError) as info:
            ex.run(_fails_on_rank_one)
        assert info.value.rank == 1 and info.value.error_type == "LookupError"
        assert "no shard for rank 1" in str(info.value)


@pytest.mark.timeout(180)
def test_ring_trainer_fit_over_ray_client_keeps_checkpoints_and_resumes_after_a_failure(
    client, tmp_path, capsys
):
    trainer = RingTrainer(
        _checkpointed_loop,
        train_loop_config={"marker": str(tmp_path / "failed_once")},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="client",
            storage_path=str(tmp_path),
            failure_config=FailureConfig(max_failures=1),
            checkpoint_config=CheckpointConfig(num_to_keep=2),
        ),
    )
    result = trainer.fit()
    assert (tmp_path / "failed_once").exists()
    # attempt 1 reported iterations 0 and 1, then rank 1 failed; attempt 2 resumed at 2
    assert list(result.metrics_dataframe["iteration"]) == [0, 1, 2]
    assert result.metrics == {"iteration": 2, "sum": 4.0, "start": 2}
    assert result.path == str(tmp_path / "client")
    assert result.checkpoint is not None
    assert result.checkpoint.path == str(tmp_path / "client" / "checkpoint_000002")
    assert (tmp_path / "client" / "checkpoint_000002" / "it").read_text() == "2"
    # num_to_keep=2, and the driver's visibility marker is gone again (.ringtrain: the
    # checkpoints' commit records)
    assert sorted(p.name for p in (tmp_path / "client").iterdir()) == [
        ".ringtrain",
        "checkpoint_000001",
        "checkpoint_000002",
    ]
    out = capsys.readouterr().out
    assert "[RingTrainer] iteration 3: iteration=2, sum=4, start=2 (checkpoint_000002)" in out
    assert "[RingTrainer] rank 1 failed (RuntimeError: the first attempt fails on rank 1)" in out


@pytest.mark.timeout(60)
def test_elastic_fit_over_ray_client_is_refused_naming_the_fix_before_any_worker_starts(
    client, tmp_path
):
    trainer = RingTrainer(
        _fails_on_rank_one,
        scaling_config=ScalingConfig(num_workers=(1, 2)),
        run_config=RunConfig(name="elastic", storage_path=str(tmp_path)),
    )
    with pytest.raises(RingError, match=r"cannot run from a Ray Client driver") as info:
        trainer.fit()
    message = str(info.value)
    assert "num_workers=(1, 2)" in message
    assert "ray job submit" in message and "integer num_workers" in message
    assert not (tmp_path / "elastic").exists()  # refused before anything was made


@pytest.mark.timeout(60)
def test_run_folder_that_the_cluster_cannot_see_is_refused_under_ray_client(client, tmp_path):
    from ray_runner._cluster import check_visible_on_cluster

    check_visible_on_cluster(str(tmp_path))  # the same machine: visible, no error
    assert list(tmp_path.iterdir()) == []  # the marker is removed
    # A driver whose disk the cluster does not share cannot be made on one machine: the
    # cluster-side look-up (our seam, run as a real Ray task) answers "not there".
    gone = tmp_path / "driver_only"
    gone.mkdir()
    import ray_runner._cluster as cluster_mod

    real = cluster_mod._sees_marker
    try:
        cluster_mod._sees_marker = lambda path: False
        with pytest.raises(RingError, match=r"not visible on the cluster") as info:
            check_visible_on_cluster(str(gone))
    finally:
        cluster_mod._sees_marker = real
    assert "storage_path" in str(info.value) and str(gone) in str(info.value)
