"""``spark_runner.run``: a function on ``num_proc`` tasks of one Spark barrier stage."""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import replace
from typing import Any

import cloudpickle

from ringcore import RingError, cuda_built
from ringcore.launch import (
    NICS_ENV_VARS,
    LogServer,
    dumps_with_user_code,
    find_worker_error,
    get_float,
    new_secret,
    nic_names,
)
from ringcore.progress import ProgressDisplay, progress_enabled, say

from . import _connect
from ._errors import executor_import_error, executors_python
from ._platform import defaults
from ._resources import ResourceSource, StagePlan, stage_resources
from ._script import as_program
from ._session import application_id, connect_session, is_connect
from ._slots import default_num_proc, retries_configured, wait_for_slots
from ._task import TaskSpec, make_barrier_task

log = logging.getLogger("ringtrain.spark_runner")

START_TIMEOUT_ENV_VAR = "RING_SPARK_START_TIMEOUT"
#: Comma-separated host names, one per rank: the hosts local/cross ranks are derived
#: from, instead of the tasks' real addresses (to test topology-aware code on one machine).
TOPOLOGY_HOSTS_ENV_VAR = "RING_SPARK_TOPOLOGY_HOSTS"


def _active_session():
    from pyspark.sql import SparkSession

    # The active session is per thread; a session made on another thread serves too.
    spark = (
        SparkSession.getActiveSession() or SparkSession._instantiatedSession or connect_session()
    )
    if spark is None:
        raise RingError(
            "spark_runner.run needs an active SparkSession; create one first, e.g. "
            "spark_runner.local_session() or SparkSession.builder.getOrCreate()."
        )
    return spark


def _say(verbose: int, needed: int, msg: str, *args: Any) -> None:
    """``ringcore.progress.say`` on this module's logger."""
    say(log, verbose, needed, msg, *args)


def _check_options(fn, env, verbose, use_gpu, progress=None) -> None:
    if progress not in (None, True, False):
        raise TypeError(f"progress must be None, True or False, got {progress!r}")
    if not callable(fn):
        raise TypeError(f"run takes a callable as fn, got {type(fn).__name__}")
    if env is not None and not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise TypeError("env must map str to str, e.g. {'OMP_NUM_THREADS': '1'}")
    if isinstance(verbose, bool) or not isinstance(verbose, int) or verbose < 0:
        raise ValueError(f"verbose must be 0 (quiet), 1 (default) or 2 (more), got {verbose!r}")
    if use_gpu not in (None, True, False):
        raise TypeError(f"use_gpu must be None, True or False, got {use_gpu!r}")
    if use_gpu and not cuda_built():
        raise RingError(
            "use_gpu=True but this installation's torch has no CUDA (torch.version.cuda is "
            "None). Install a CUDA build of torch, or pass use_gpu=False to train on CPU."
        )


#: The variables ``nics=`` sets in every task: ringtrain's own and those Gloo and NCCL read.
IFACE_ENV_VARS = NICS_ENV_VARS


def horovod_options_env(
    env: dict[str, str] | None,
    use_gloo: Any = None,
    use_mpi: Any = None,
    extra_mpi_args: Any = None,
    nics: Any = None,
    executable: Any = None,
) -> dict[str, str]:
    """Check Horovod's launcher options of ``run`` / ``run_elastic``; the tasks' env with
    ``nics`` applied (every variable of :data:`IFACE_ENV_VARS`, comma-joined)."""
    for name, value in (("use_gloo", use_gloo), ("use_mpi", use_mpi)):
        if value not in (None, True, False):
            raise TypeError(f"{name} must be None, True or False, got {value!r}")
    if use_mpi or extra_mpi_args:
        given = "use_mpi=True" if use_mpi else f"extra_mpi_args={extra_mpi_args!r}"
        raise ValueError(
            f"{given}: MPI under Spark is not supported; spark_runner launches the ranks as "
            "Spark barrier tasks that form a Gloo ring (NCCL between GPUs). Drop use_mpi / "
            "extra_mpi_args (use_gloo=True, the default, is fine); for MPI, launch the script "
            "with mpirun instead."
        )
    if use_gloo is False:
        raise ValueError(
            "use_gloo=False: spark_runner has no controller but Gloo (MPI under Spark is not "
            "supported). Drop use_gloo, or pass use_gloo=True."
        )
    if executable is not None and executable != sys.executable:
        raise ValueError(
            f"executable={executable!r}: the ranks run inside Spark's own Python workers, so "
            "spark_runner cannot choose their interpreter. Set spark.pyspark.python (or "
            "PYSPARK_PYTHON) when you create the SparkSession, and drop executable."
        )
    env = dict(env or {})
    if nics is None:
        return env
    joined = ",".join(nic_names(nics, hosts=" of the executors' hosts"))
    clash = [k for k in IFACE_ENV_VARS if k in env and env[k] != joined]
    if clash:
        raise ValueError(
            f"nics={nics!r} and env[{clash[0]!r}]={env[clash[0]]!r} both choose the data-plane "
            "interface; pass one of them."
        )
    env.update(dict.fromkeys(IFACE_ENV_VARS, joined))
    return env


def resolve_timeout(start_timeout: float | None) -> float:
    """``start_timeout``, else ``RING_SPARK_START_TIMEOUT``, else 600 s (900 s on
    Databricks); checked."""
    timeout = (
        start_timeout
        if start_timeout is not None
        else get_float(START_TIMEOUT_ENV_VAR, defaults().start_timeout_s)
    )
    if timeout <= 0:
        raise ValueError(f"start_timeout must be > 0 seconds, got {timeout}")
    return float(timeout)


def _check_num_proc(num_proc: Any) -> int:
    if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
        raise ValueError(f"num_proc must be a positive integer, got {num_proc!r}")
    return num_proc


def _topology_hosts(num_proc: int) -> tuple[str, ...]:
    raw = os.environ.get(TOPOLOGY_HOSTS_ENV_VAR, "").strip()
    if not raw:
        return ()
    hosts = tuple(h.strip() for h in raw.split(","))
    if len(hosts) != num_proc or not all(hosts):
        raise ValueError(
            f"{TOPOLOGY_HOSTS_ENV_VAR} names {len(hosts)} hosts ({raw!r}) but num_proc is "
            f"{num_proc}; give one host per rank or unset it."
        )
    return hosts


def _stage_attempt(sc: Any, stage_id: int) -> int:
    info = sc.statusTracker().getStageInfo(stage_id)
    return int(info.currentAttemptId) if info is not None else 0


def driver_address(spark: Any) -> tuple[str, str]:
    """Where the tasks reach this process, and the address its servers listen on: on a
    classic session ``spark.driver.host`` / ``spark.driver.bindAddress``; on a Connect
    client (which is not Spark's driver) its address on the route to the server."""
    if is_connect(spark):
        host = _connect.client_address(spark)
        return host, defaults().log_bind_host or host
    conf = spark.sparkContext.getConf()
    host = conf.get("spark.driver.host", "127.0.0.1")
    return host, conf.get("spark.driver.bindAddress", defaults().log_bind_host or host)


def _log_server(
    spark: Any, stdout: Any, stderr: Any, num_proc: int, display: ProgressDisplay | None = None
) -> LogServer:
    host, bind = driver_address(spark)
    attempt_of: Any = (  # a Connect client has no status tracker: count the connections
        _connect.AttemptCounter(num_proc)
        if is_connect(spark)
        else functools.partial(_stage_attempt, spark.sparkContext)
    )
    return LogServer(
        stdout if stdout is not None else sys.stdout,
        stderr if stderr is not None else sys.stderr,
        bind_host=bind,
        attempt_of=attempt_of,
        advertised_host=host,
        on_progress=display.update if display is not None else None,
    )


def run(
    fn,
    args: tuple = (),
    kwargs: dict | None = None,
    num_proc: int | None = None,
    start_timeout: float | None = None,
    env: dict[str, str] | None = None,
    stdout: Any = None,
    stderr: Any = None,
    verbose: int = 1,
    prefix_output_with_timestamp: bool = False,
    use_gpu: bool | None = None,
    use_gloo: bool | None = None,
    use_mpi: bool | None = None,
    extra_mpi_args: str | None = None,
    nics: Any = None,
    executable: str | None = None,
    progress: bool | None = None,
    resources: dict[str, float] | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``num_proc`` ranks, one Spark task each, and
    return every rank's return value ordered by rank.

    Inside ``fn``, ``ringcore.init()`` (or ``hvd.init()``) joins the ring with no other
    setting, and a ``torch.distributed`` program runs as under torchrun: every task has
    torchrun's ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ... and ``MASTER_ADDR`` /
    ``MASTER_PORT`` (a free port on rank 0's host), so ``init_process_group()`` (env://),
    Lightning and the Hugging Face Trainer form the job's group (one per job, whoever
    forms it first). ``fn`` may instead be the path of a Python file, with ``args`` its
    command line (strings): each task runs it as ``python PATH ARGS`` would, in a process
    of its own; each rank's result is then None and a non-zero exit raises
    ``WorkerError`` with its ``exit_code`` (``spark_runner._script``: which copy runs).

    A worker's exception is raised here as :class:`ringcore.WorkerError` carrying its
    rank, host and traceback (Spark's own log lines for the failed task show only its
    summary). What the workers print reaches ``stdout`` /
    ``stderr`` (default: this process's) live, each line prefixed ``[rank]<stdout>:``
    (after a timestamp with ``prefix_output_with_timestamp``); all of it is written
    before the end line. ``verbose``: 0 quiet, 1 a line at launch and end, 2 more
    (logger ``ringtrain.spark_runner``; without any logging configured these lines go
    to stderr).

    ``progress``: when ``fn`` calls ``spark_runner.progress(step=..., total=...,
    loss=...)``, rank 0's reports drive a progress bar on ``stdout`` (a tqdm bar on a
    terminal, the widget in a notebook, else a line every few seconds). None (the
    default) and True show it when ``verbose >= 1`` and ``RING_PROGRESS`` is not 0;
    False never.

    ``use_gpu``: None pins the GPUs Spark assigns to each task
    (``spark.task.resource.gpu.amount``) when there are any; True also pins by local
    rank without such resources, and needs a CUDA build; False never pins. Pinning sets
    ``CUDA_VISIBLE_DEVICES`` and ``RING_GPU_ADDRESSES`` (use
    ``spark.python.worker.reuse=false`` so a reused worker has not initialized CUDA).

    ``resources``: what each task asks Spark for, e.g. ``{"gpu": 1, "cpus": 1}`` (each key
    optional, ``cpus`` defaulting to ``spark.task.cpus``); ``use_gpu=True`` asks for
    ``gpu=1``. Where the session's settings do not already give it, the barrier stage gets
    a task ResourceProfile (stage-level scheduling: standalone, YARN, Kubernetes), so the
    application's other stages keep every CPU slot; each task pins the GPUs Spark gave it.
    Where Spark cannot give it (``local[N]``, no GPUs on the executors), ``use_gpu=True``
    alone pins by local rank as above, and ``resources`` raises before any job. A log line
    says which was used (see ``spark_runner._resources``). No CUDA is touched on the driver.

    When Spark may retry (``local[N,F]`` with F > 1, or ``spark.task.maxFailures`` > 1),
    a failed stage is rerun as a whole (up to ``spark.stage.maxConsecutiveAttempts``);
    ``os.environ["RING_SPARK_ATTEMPT"]`` is then 1, 2, ... so ``fn`` can resume, e.g.
    from its last checkpoint (negative, still larger for each later attempt, when no
    task could reach this driver: see ``spark_runner._task``).

    On a Spark Connect session (``SparkSession.builder.remote(...)``) the stage is a
    ``mapInArrow(..., barrier=True)`` and results come back in chunks; cancellation is
    by operation tag; retries as above, from the server's conf (see
    ``spark_runner._connect``).

    Horovod's launcher options: ``nics`` (interface names, e.g. ``{"eth0"}``) sets the
    data-plane interface of every task (``RING_IFACE``, ``GLOO_SOCKET_IFNAME``,
    ``NCCL_SOCKET_IFNAME``); ``use_gloo=True`` is the default anyway; ``use_mpi=True`` or
    ``extra_mpi_args`` raise (MPI under Spark is not supported); ``executable`` other than
    this interpreter raises (set ``spark.pyspark.python``).
    """
    fn, args, kwargs = as_program(fn, args, kwargs)  # a script: checked before any job
    _check_options(fn, env, verbose, use_gpu, progress)
    show = verbose >= 1 and progress_enabled(progress)
    env = horovod_options_env(env, use_gloo, use_mpi, extra_mpi_args, nics, executable)
    spark = _active_session()
    connect = is_connect(spark)
    sc = None if connect else spark.sparkContext
    if num_proc is None:  # the cluster's parallelism
        num_proc = default_num_proc(spark)
    num_proc = _check_num_proc(num_proc)
    timeout = resolve_timeout(start_timeout)
    topology_hosts = _topology_hosts(num_proc)
    plan = stage_resources(spark, resources, use_gpu)  # no job; refuses what Spark cannot give
    if plan.source is not ResourceSource.DEFAULT:
        _say(verbose, 1, "%s", plan.describe())
    slots = wait_for_slots(spark, num_proc, timeout, plan)  # classic or Connect
    _say(verbose, 2, "the cluster offers %d task slots for %d ranks", slots, num_proc)
    payload = dumps_with_user_code((fn, tuple(args), dict(kwargs or {})), fn)
    name = getattr(fn, "__name__", "fn")
    display = ProgressDisplay(stdout, desc=name).open() if show else None
    server = _log_server(spark, stdout, stderr, num_proc, display)
    spec = TaskSpec(
        num_proc=num_proc,
        env=dict(env or {}),
        log_host=server.advertised_host,
        log_port=server.port,
        secret=server.secret,
        ring_secret=new_secret(),  # separate from the log secret, which stays out of env
        timestamps=bool(prefix_output_with_timestamp),
        use_gpu=use_gpu,
        topology_hosts=topology_hosts,
        run_id=application_id(spark),
    )
    started = time.monotonic()
    try:
        if connect:
            blobs = _run_connect_stage(spark, fn, payload, spec, verbose, server, plan)
        else:
            blobs = _run_stage(sc, fn, payload, spec, verbose, server, plan)
    finally:
        server.close()  # drains: every line of the tasks is written now
        if display is not None:
            display.flush()  # rank 0's last progress, before the end line
            display.close()
    results = dict(cloudpickle.loads(b) for b in blobs)
    _say(
        verbose, 1, "%s finished on %d ranks in %.1f s", name, num_proc, time.monotonic() - started
    )
    return [results[r] for r in range(num_proc)]


@contextlib.contextmanager
def _plain_keyboard_interrupt():
    """Ctrl-C raises KeyboardInterrupt here (so ``_run_stage`` cancels its job group, and
    ``_connect.run_stage`` interrupts its tag) instead of PySpark's handler, which calls
    into Py4J from inside a Py4J read — or, left installed by a classic SparkContext that
    was stopped, into a context that is gone. Yields
    a list that holds True once Ctrl-C came (Py4J may turn the interrupt into its own
    network error)."""
    interrupted: list[bool] = []
    if threading.current_thread() is not threading.main_thread():
        yield interrupted
        return

    def on_sigint(signum: int, frame: Any) -> None:
        interrupted.append(True)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield interrupted
    finally:
        signal.signal(signal.SIGINT, previous)


def _collect(sc: Any, payload: bytes, spec: TaskSpec, plan: StagePlan) -> list[bytes]:
    retried = retries_configured(sc.master, sc.getConf().get("spark.task.maxFailures"))
    rdd = sc.parallelize(range(spec.num_proc), spec.num_proc).barrier()
    task = make_barrier_task(payload, replace(spec, all_or_none=retried))
    stage = plan.apply(rdd.mapPartitions(task))  # the barrier stage's own profile, if any
    if retried:
        stage = stage.map(lambda blob: (0, blob)).partitionBy(1).values()
    return stage.collect()


def _run_stage(
    sc: Any,
    fn,
    payload: bytes,
    spec: TaskSpec,
    verbose: int,
    server: LogServer,
    plan: StagePlan,
) -> list[bytes]:
    """One barrier stage under its own job group; cancelled if anything interrupts it."""
    name, num_proc = getattr(fn, "__name__", "fn"), spec.num_proc
    group = f"ringtrain-{uuid.uuid4().hex[:12]}"
    sc.setJobGroup(
        group, f"ringtrain spark_runner.run of {name} on {num_proc} tasks", interruptOnCancel=True
    )
    _say(verbose, 1, "launching %s on %d Spark barrier tasks (job group %s)", name, num_proc, group)
    try:
        with _plain_keyboard_interrupt() as interrupted:
            return _collect(sc, payload, spec, plan)
    except BaseException as exc:
        sc.cancelJobGroup(group)  # no task, and no Python worker, outlives the call
        if not isinstance(exc, Exception):
            raise
        if interrupted:
            raise KeyboardInterrupt from exc
        server.drain()  # every task's error and last lines are in
        worker_error = find_worker_error(str(exc), server, spec.secret)
        if worker_error is not None:
            raise worker_error from None
        what = f"spark_runner.run of {name} on {num_proc} tasks"
        missing = executor_import_error(
            str(exc), executors_python(getattr(sc, "pythonExec", None), sc.getConf().get), what
        )
        if missing is not None:
            raise missing from exc
        raise RingError(f"the Spark barrier stage of {num_proc} tasks failed: {exc}") from exc
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
        sc.setLocalProperty("spark.job.description", None)


def _run_connect_stage(
    spark: Any,
    fn,
    payload: bytes,
    spec: TaskSpec,
    verbose: int,
    server: LogServer,
    plan: StagePlan,
) -> list[bytes]:
    name, num_proc = getattr(fn, "__name__", "fn"), spec.num_proc
    _say(verbose, 1, "launching %s on %d Spark Connect barrier tasks", name, num_proc)
    with _plain_keyboard_interrupt():
        return _connect.run_stage(spark, payload, spec, server, plan.profile)
