"""spark_runner.run and run_elastic on a Spark Connect session: a real Spark Connect server
started from the pyspark package (``spark-submit --class ...SparkConnectServer``) on
127.0.0.1 with ``local[2]`` (``local[2,2]``, which retries failed tasks, for the stage-retry
and the elastic tests), stopped by PID at the end; the barrier stage is
``mapInArrow(barrier=True)``, an elastic worker a one-task ``mapInArrow`` job."""

from __future__ import annotations

import io
import os
import signal
import threading
import time

import _connect_server
import pytest
from _elastic_train import assert_every_sample_trained_once_per_epoch, train_losing_one_worker

import spark_runner
from ringcore import WorkerError
from spark_runner import is_connect
from spark_runner._connect import CHUNK_BYTES

pytestmark = pytest.mark.spark
SHARED_CONNECT = True  # its local[2] server is tests/_connect_server.py's shared one


@pytest.fixture(scope="module")
def connect_server(request, tmp_path_factory):
    """A server on ``local[2]``, or on the master a test names with
    ``@pytest.mark.parametrize("connect_server", [master], indirect=True)`` (pytest stops
    the other server, and the session on it, before starting that one)."""
    master = getattr(request, "param", None)
    if master is None:  # the test process's local[2] server (tests/_connect_server.py)
        yield _connect_server.shared_server()[0]
        return
    work = tmp_path_factory.mktemp("spark-connect")
    with _connect_server.connect_server(work, master, name="test_spark_connect") as url:
        yield url


@pytest.fixture(scope="module")
def spark(connect_server):
    with _connect_server.remote_session(connect_server) as session:
        yield session


def _ring(size):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    print(f"rank {hvd.rank()} of {hvd.size()} says hi")
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    big = bytes(range(256)) * (size // 256) + bytes([hvd.rank()]) * (hvd.rank() + 1)
    return hvd.rank(), hvd.size(), total, os.getpid(), big


@pytest.mark.timeout(120)
def test_run_on_spark_connect_returns_each_ranks_allreduce_in_rank_order(spark):
    assert is_connect(spark)
    out = io.StringIO()
    size = 2 * CHUNK_BYTES + 1000  # three chunks per rank
    results = spark_runner.run(_ring, args=(size,), num_proc=2, stdout=out)
    assert [r[:3] for r in results] == [(0, 2, 3.0), (1, 2, 3.0)]
    assert len({r[3] for r in results}) == 2  # two worker processes
    for rank, result in enumerate(results):  # the large value came back whole, in order
        expected = bytes(range(256)) * (size // 256) + bytes([rank]) * (rank + 1)
        assert len(result[4]) > CHUNK_BYTES and result[4] == expected
    lines = out.getvalue().splitlines()
    assert "[0]<stdout>:rank 0 of 2 says hi" in lines
    assert "[1]<stdout>:rank 1 of 2 says hi" in lines


def _ddp_on_env() -> tuple[int, int, list[float]]:
    """A TorchDistributor training function as PySpark's users write it: env://, DDP."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1, bias=False))
    model(torch.full((1, 2), float(dist.get_rank() + 1))).sum().backward()
    rank, size = dist.get_rank(), dist.get_world_size()
    dist.destroy_process_group()
    return rank, size, model.module.weight.grad.flatten().tolist()


@pytest.mark.timeout(120)
def test_torch_distributor_runs_an_env_rendezvous_ddp_function_on_connect(spark):
    """One import changed (pyspark.ml.torch.distributor -> spark_runner): the function
    runs on the server's slots and rank 0's return value comes back."""
    distributor = spark_runner.TorchDistributor(num_processes=2, local_mode=False, use_gpu=False)
    rank, size, grad = distributor.run(_ddp_on_env)
    assert (rank, size) == (0, 2)
    assert grad == [1.5, 1.5]  # DDP's average of the ranks' inputs 1 and 2


def _fails_on_rank_one():
    import ringcore.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise KeyError("label column vanished")
    hvd.barrier()


@pytest.mark.timeout(90)
def test_a_worker_exception_on_connect_is_raised_naming_its_rank(spark):
    with pytest.raises(WorkerError) as info:
        spark_runner.run(_fails_on_rank_one, num_proc=2)
    err = info.value
    assert err.rank == 1 and err.error_type == "KeyError" and err.host == "127.0.0.1"
    assert "label column vanished" in str(err) and "_fails_on_rank_one" in err.traceback


@pytest.mark.timeout(60)
def test_num_proc_beyond_the_servers_slots_is_refused_before_the_stage(spark):
    with pytest.raises(spark_runner.NotEnoughSlotsError) as info:
        spark_runner.run(_fails_on_rank_one, num_proc=3)
    message = str(info.value)
    assert "needs 3 task slots" in message and "has 2" in message
    assert "master local[2]" in message and "Lower num_proc to 2" in message
    with pytest.raises(ValueError, match="num_proc must be a positive integer, got 0"):
        spark_runner.run(_fails_on_rank_one, num_proc=0)
    with pytest.raises(spark_runner.NotEnoughSlotsError, match=r"has 2 \(master local\[2\]"):
        spark_runner.run_elastic(_fails_on_rank_one, num_proc=3, min_num_proc=3)


def _sleeps(pid_dir):
    with open(os.path.join(pid_dir, str(os.getpid())), "w"):
        pass
    time.sleep(60)


def _alive(pid):
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.timeout(90)
def test_keyboard_interrupt_on_the_client_interrupts_the_stage_and_its_workers(spark, tmp_path):
    main = threading.main_thread().ident
    assert main is not None and threading.get_ident() == main
    pids: list[int] = []

    def interrupt():
        deadline = time.monotonic() + 60
        while len(pids) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            pids[:] = [int(p) for p in os.listdir(tmp_path)]
        signal.pthread_kill(main, signal.SIGINT)

    def stale_handler(signum, frame):
        raise AttributeError("'NoneType' object has no attribute 'sc'")

    # What a classic SparkContext that was started and stopped earlier in this process
    # leaves installed: pyspark's SIGINT handler, calling into a context that is gone.
    # run() takes Ctrl-C with its own handler while the stage runs.
    previous = signal.signal(signal.SIGINT, stale_handler)
    try:
        helper = threading.Thread(target=interrupt, daemon=True)
        helper.start()
        with pytest.raises(KeyboardInterrupt):
            spark_runner.run(_sleeps, args=(str(tmp_path),), num_proc=2)
        helper.join(5)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert len(pids) == 2
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a worker process outlived the interrupted run"
    # and the session still works after the interrupt
    assert spark.range(3).count() == 3


def _dies_on_the_first_attempt():
    import ringcore

    ringcore.init()
    attempt = os.environ[spark_runner.ATTEMPT_ENV_VAR]
    if attempt == "0" and ringcore.rank() == 1:
        os._exit(3)  # the worker process dies, as a killed or crashed one does
    return ringcore.rank(), int(attempt)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("connect_server", ["local[2,2]"], indirect=True)
def test_a_failed_stage_on_connect_is_retried_with_the_next_attempt_number(spark):
    assert is_connect(spark) and spark.conf.get("spark.master") == "local[2,2]"
    results = spark_runner.run(_dies_on_the_first_attempt, num_proc=2)
    assert results == [(0, 1), (1, 1)]


@pytest.mark.reliability(
    fault="a Spark task lost under run_elastic on Spark Connect, retried by Spark",
    category="fault",
)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("connect_server", ["local[2,2]"], indirect=True)
def test_run_elastic_on_connect_reforms_with_the_retried_task_and_trains_every_epoch(spark):
    out = io.StringIO()
    results = spark_runner.run_elastic(
        train_losing_one_worker,
        args=(3, 1, 2),  # slot 1's first task dies at step 3 of the ring of two
        num_proc=2,
        stdout=out,
        stderr=io.StringIO(),
    )
    assert [r[2:4] for r in results] == [(0, 2), (1, 2)]
    workers = {r[4]: r[5] for r in results}  # worker id -> its task's attempt number
    assert sorted(w.split("-")[0] for w in workers) == ["0", "1"]
    assert workers[next(w for w in workers if w.startswith("1-"))] == 1  # Spark's retry
    for trained, sizes, *_ in results:
        assert sizes == [2, 2]  # formed on 2; re-formed on 2 with the retried task
        assert_every_sample_trained_once_per_epoch(trained)
    assert results[0][0] == results[1][0]  # every rank holds the same trained steps
    lines = out.getvalue().splitlines()
    assert lines.count("[0]<stdout>:ring of 2") == 2 and lines.count("[1]<stdout>:ring of 2") == 2
