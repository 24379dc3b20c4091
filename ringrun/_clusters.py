"""``ringrun --spark`` / ``--ray`` / ``--mpi``: the ranks started by a cluster or by mpirun.

``--spark [--master URL]``: the command runs in each task of one Spark barrier stage
(``spark_runner.run``), on a session made from ``--master``: ``local[N]`` /
``local-cluster[...]`` (``spark_runner.local_session``), ``sc://host:port`` (Spark
Connect), any other master URL as it is, or none (what ``spark-submit`` / the Spark
defaults say). ``--ray [--address A]``: the command runs in each actor of a
``ray_runner.RayExecutor`` after ``ray.init(address=A)`` (no address: a Ray instance of
this machine, started for the job). Each rank runs the command through
``ringcore.launch.run_command`` in ringrun's working directory when that exists on its
host; a failing rank's own exit status becomes ringrun's.

``--mpi``: ringrun runs ``mpiexec`` (next to this interpreter, else on ``PATH``) with
``-np``, the hosts and the knobs' variables; the ranks learn their topology from MPI and
use ringcore's MPI backend. MPICH's Hydra (``-prepend-rank``: lines start ``[rank]``)
and Open MPI (``--tag-output``) are known.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Any

from ringcore import WorkerError
from ringcore.launch import RANK_ENV_VAR, nics_env, run_command

from ._args import Options, UsageError
from ._remote import exit_status
from ._ssh import SSH_ENV_VAR

__all__ = ["run_mpi", "run_on_ray", "run_on_spark", "run_rank"]


class _ToDriver:
    """A text stream that sends each line ``run_command`` copies to ringrun's process,
    prefixed, through ``ray_runner.ray_logger`` (drained by the executor before its
    ``run`` returns or raises; Ray's own log forwarding may still hold lines when
    ringrun exits)."""

    def __init__(self, name: str, prefix: str):
        self.name, self.prefix = name, prefix

    def write(self, text: str) -> int:
        from ray_runner import ray_logger

        ray_logger.log((self.name, self.prefix + text))
        return len(text)

    def flush(self) -> None:
        pass


def _print_line(value: Any) -> None:
    """On ringrun's side: a line a rank sent (``_ToDriver``)."""
    name, text = value
    stream = sys.stderr if name == "stderr" else sys.stdout
    stream.write(text)
    stream.flush()


def run_rank(argv: list[str], cwd: str, to_driver: bool = False) -> int:
    """In a worker: run ``argv`` (in ``cwd`` if this host has it); with ``to_driver``
    (Ray), its lines go to ringrun prefixed ``[rank]<stdout>:`` (``_ToDriver``)."""
    where = cwd if os.path.isdir(cwd) else None
    if not to_driver:
        return run_command(argv, cwd=where)
    rank = os.environ.get(RANK_ENV_VAR, "?")
    out, err = sys.stdout, sys.stderr
    sys.stdout = _ToDriver("stdout", f"[{rank}]<stdout>:")
    sys.stderr = _ToDriver("stderr", f"[{rank}]<stderr>:")
    try:
        return run_command(argv, cwd=where)
    finally:
        sys.stdout, sys.stderr = out, err


def _env(opts: Options) -> dict[str, str]:
    return {**dict(opts.env), **nics_env(opts.nics or None)}


def _failed(exc: WorkerError) -> int:
    print(f"ringrun: rank {exc.rank} on {exc.host}: {exc.message}", file=sys.stderr, flush=True)
    return exc.exit_code if exc.exit_code else 1


def _spark_session(master: str | None) -> Any:
    from pyspark.sql import SparkSession

    from spark_runner import local_session

    if master and master.startswith("sc://"):
        return SparkSession.builder.remote(master).appName("ringrun").getOrCreate()
    if master and master.startswith("local"):
        return local_session(master, app_name="ringrun", log_level="ERROR")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    builder = SparkSession.builder.appName("ringrun")
    return (builder.master(master) if master else builder).getOrCreate()


def run_on_spark(opts: Options) -> int:
    import spark_runner

    spark = _spark_session(opts.master)
    try:
        spark_runner.run(
            run_rank,
            args=(list(opts.command), os.getcwd()),
            num_proc=opts.np,
            start_timeout=opts.start_timeout,
            env=_env(opts),
            verbose=2 if opts.verbose else 0,
            progress=False,
        )
        return 0
    except WorkerError as exc:
        return _failed(exc)
    finally:
        spark.stop()


def run_on_ray(opts: Options) -> int:
    import ray

    from ray_runner import RayExecutor

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")  # every rank's lines, not one of them
    if opts.address:
        ray.init(address=opts.address, log_to_driver=True)
    else:
        cpus = max(opts.np, os.cpu_count() or 1)
        ray.init(num_cpus=cpus, include_dashboard=False, log_to_driver=True)
    executor = RayExecutor(num_workers=opts.np)
    try:
        executor.start(extra_env_vars=_env(opts))
        executor.run(
            run_rank, args=(list(opts.command), os.getcwd(), True), callbacks=[_print_line]
        )
        return 0
    except WorkerError as exc:
        return _failed(exc)
    finally:
        executor.shutdown()
        ray.shutdown()


def _mpiexec() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = beside if os.path.exists(beside) else shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise UsageError(
            "--mpi: no mpiexec next to this Python nor on PATH; pip install 'ringtrain[mpi]' "
            "(or install MPI), or drop --mpi: ringrun starts the ranks itself"
        )
    return found


def mpi_command(opts: Options, mpiexec: str, version: str) -> list[str]:
    """The mpiexec argv of ``opts`` (MPICH's Hydra, or Open MPI when ``version`` says so)."""
    env = _env(opts)
    hosts = ",".join(f"{h}:{n}" for h, n in opts.hosts)
    if "Open MPI" in version or "OpenRTE" in version:
        argv = [mpiexec, "-np", str(opts.np), "--tag-output"]
        argv += ["-H", hosts] if hosts else []
        for k, v in env.items():
            argv += ["-x", f"{k}={v}"]
        return [*argv, *opts.command]
    argv = [mpiexec, "-n", str(opts.np), "-prepend-rank"]
    argv += ["-hosts", hosts] if hosts else []
    if os.environ.get(SSH_ENV_VAR):
        argv += ["-launcher", "ssh", "-launcher-exec", os.environ[SSH_ENV_VAR]]
    for k, v in env.items():
        argv += ["-genv", k, v]
    return [*argv, *opts.command]


def run_mpi(opts: Options) -> int:
    mpiexec = _mpiexec()
    version = subprocess.run(
        [mpiexec, "--version"], capture_output=True, text=True, stdin=subprocess.DEVNULL
    ).stdout
    argv = mpi_command(opts, mpiexec, version)
    if opts.verbose:
        print(f"ringrun: {' '.join(argv)}", file=sys.stderr, flush=True)
    proc = subprocess.Popen(argv)
    try:
        return exit_status(proc.wait())
    except KeyboardInterrupt:  # mpiexec got the terminal's SIGINT too and ends the ranks
        return exit_status(proc.wait())
