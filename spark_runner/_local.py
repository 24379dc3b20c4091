"""``TorchDistributor(local_mode=True)``: the ranks as processes on the driver, no Spark job.

As torchrun on one node: ``num_proc`` fresh interpreters on this machine, each with the
environment a Spark task gets (the ``RING_*`` variables, torchrun's ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ..., ``MASTER_ADDR=127.0.0.1`` and a free
``MASTER_PORT``; ``CUDA_VISIBLE_DEVICES`` by local rank with ``use_gpu``). This process
hosts the job's store. A function travels pickled in a file and each rank writes its
result (or its :class:`ringcore.WorkerError`) to a file of its own
(``spark_runner._local_rank``); a script runs as ``python PATH ARGS``
(``script_command``). Every line a rank prints reaches ``stdout`` / ``stderr`` prefixed
``[rank]<stdout>:`` as on Spark. The first rank to fail ends the others (SIGTERM to
each one's process group, SIGKILL after a grace) and is raised as ``WorkerError``,
with ``exit_code`` the process's exit status.
"""

from __future__ import annotations

import datetime
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import IO, Any

import cloudpickle

from ringcore import WorkerError, topology_from_hosts, worker_env
from ringcore.launch import (
    ShippedScript,
    dumps_with_user_code,
    free_port,
    new_secret,
    script_command,
    torchrun_env,
)

__all__ = ["run_local"]

LOOPBACK = "127.0.0.1"
#: seconds a rank has to exit after SIGTERM before it is killed
TERM_GRACE_S = 5.0
#: seconds the job's store waits for a rank's request (the ranks' own start timeout rules)
STORE_TIMEOUT_S = 3600.0


def _rank_env(
    rank: int,
    num_proc: int,
    store_port: int,
    master_port: int,
    run_id: str,
    secret: str,
    use_gpu: bool,
) -> dict[str, str]:
    topology = topology_from_hosts([LOOPBACK] * num_proc, rank)
    env = worker_env(topology, LOOPBACK, store_port, external_store=True, secret=secret)
    env.update(torchrun_env(topology, LOOPBACK, master_port, run_id))
    if use_gpu:
        own = [d.strip() for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")]
        own = [d for d in own if d]
        env["CUDA_VISIBLE_DEVICES"] = own[rank % len(own)] if own else str(rank)
    return env


def _copy(source: IO[bytes], sink: Any, prefix: str, tail: list[str]) -> None:
    for raw in iter(source.readline, b""):
        line = raw.decode("utf-8", "replace")
        tail[:] = [*tail[-19:], line]
        sink.write(f"{prefix}{line}")
        sink.flush()
    source.close()


class _Rank:
    """One rank's process and the threads that forward its output."""

    def __init__(self, rank: int, argv: list[str], env: dict[str, str], out: Any, err: Any):
        self.rank, self.tail = rank, []  # type: ignore[var-annotated]
        self.proc = subprocess.Popen(
            argv,
            env={**os.environ, **env},
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,  # its own group: ending it ends what it started
        )
        self.copiers = [
            threading.Thread(
                target=_copy, args=(pipe, sink, f"[{rank}]<{name}>:", self.tail), daemon=True
            )
            for pipe, sink, name in (
                (self.proc.stdout, out, "stdout"),
                (self.proc.stderr, err, "stderr"),
            )
        ]
        for t in self.copiers:
            t.start()

    def end(self) -> None:
        for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
            if self.proc.poll() is not None:
                break
            try:
                os.killpg(self.proc.pid, sig)
                self.proc.wait(wait_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                continue
        for t in self.copiers:
            t.join(5.0)


def _wait(ranks: list[_Rank]) -> _Rank | None:
    """Wait until every rank exited (None) or one failed (that rank)."""
    while True:
        codes = [r.proc.poll() for r in ranks]
        failed = [r for r, c in zip(ranks, codes, strict=True) if c not in (None, 0)]
        if failed:
            return failed[0]
        if all(c == 0 for c in codes):
            return None
        time.sleep(0.05)


def _failure(rank: _Rank, result_path: str | None) -> WorkerError:
    """The failed rank's own WorkerError (a function's), else one for its exit status."""
    code = rank.proc.returncode
    if result_path is not None and os.path.exists(result_path):
        with open(result_path, "rb") as f:
            status, value = cloudpickle.load(f)
        if status == "error":
            return value
    how = f"was ended by signal {-code}" if code < 0 else f"exited with code {code}"
    return WorkerError(
        rank.rank,
        LOOPBACK,
        "CommandFailedError",
        f"rank {rank.rank}'s process {how}",
        output="".join(rank.tail),
        exit_code=code,
    )


def run_local(
    program: Any,
    args: tuple,
    kwargs: dict,
    num_proc: int,
    use_gpu: bool,
    stdout: Any = None,
    stderr: Any = None,
) -> list[Any]:
    """Run ``program`` (a function, or a :class:`~ringcore.launch.ShippedScript`) on ``num_proc`` local
    processes; every rank's result by rank (None for a script)."""
    import torch.distributed as dist

    out = stdout if stdout is not None else sys.stdout
    err = stderr if stderr is not None else sys.stderr
    store = dist.TCPStore(
        LOOPBACK,
        0,
        num_proc,
        True,
        timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S),
        wait_for_workers=False,
    )
    master_port, run_id, secret = (
        free_port(LOOPBACK),
        f"local-{uuid.uuid4().hex[:12]}",
        new_secret(),
    )
    folder = tempfile.mkdtemp(prefix="ringtrain-local-")
    script = isinstance(program, ShippedScript)
    if not script:
        payload = os.path.join(folder, "payload.pickle")
        with open(payload, "wb") as f:
            f.write(dumps_with_user_code((program, tuple(args), dict(kwargs)), program))
    ranks: list[_Rank] = []
    try:
        for r in range(num_proc):
            env = _rank_env(r, num_proc, store.port, master_port, run_id, secret, use_gpu)
            argv = (
                script_command(program.path, program.args)
                if script
                else [
                    sys.executable,
                    "-m",
                    "spark_runner._local_rank",
                    payload,
                    _result_path(folder, r),
                ]
            )
            ranks.append(_Rank(r, argv, env, out, err))
        failed = _wait(ranks)
        if failed is not None:
            raise _failure(failed, None if script else _result_path(folder, failed.rank))
        for rank in ranks:
            for t in rank.copiers:
                t.join(5.0)
        return [None] * num_proc if script else [_result(folder, r) for r in range(num_proc)]
    finally:
        for rank in ranks:
            rank.end()  # a no-op for a rank that exited
        shutil.rmtree(folder, ignore_errors=True)
        del store


def _result_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.pickle")


def _result(folder: str, rank: int) -> Any:
    with open(_result_path(folder, rank), "rb") as f:
        _, value = cloudpickle.load(f)
    return value
