"""What runs inside each Spark task of the barrier stage."""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import cloudpickle

import ringcore
from ringcore import (
    RingInternalError,
    WorkerError,
    start_store_server,
    topology_from_hosts,
    worker_env,
)
from ringcore._rendezvous import stop_store_server

from ._errors import encode_worker_error

ATTEMPT_ENV_VAR = "RING_SPARK_ATTEMPT"
SECONDARY_FAILURE_DELAY_S = 2.0


class _Prefixed:
    """A text stream that prefixes every line with ``[rank]<name>:`` (Horovod's style)."""

    def __init__(self, stream: Any, prefix: str):
        self._stream, self._prefix, self._at_line_start = stream, prefix, True

    def write(self, text: str) -> int:
        out = []
        for piece in text.splitlines(keepends=True):
            if self._at_line_start:
                out.append(self._prefix)
            out.append(piece)
            self._at_line_start = piece.endswith("\n")
        self._stream.write("".join(out))
        return len(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


@contextlib.contextmanager
def _task_environment(env: dict[str, str], rank: int):
    saved_env = dict(os.environ)
    saved_out, saved_err = sys.stdout, sys.stderr
    os.environ.update(env)
    sys.stdout = _Prefixed(saved_out, f"[{rank}]<stdout>:")
    sys.stderr = _Prefixed(saved_err, f"[{rank}]<stderr>:")
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdout, sys.stderr = saved_out, saved_err
        ringcore.shutdown()
        stop_store_server()  # Spark reuses Python workers: leave nothing behind
        os.environ.clear()
        os.environ.update(saved_env)


def make_barrier_task(payload: bytes, user_env: dict[str, str], num_proc: int):
    """The function given to ``RDD.barrier().mapPartitions``."""

    def task(_: Iterator[Any]) -> Iterator[bytes]:
        from pyspark import BarrierTaskContext

        ctx = BarrierTaskContext.get()
        rank = ctx.partitionId()
        host = ctx.getTaskInfos()[rank].address.rsplit(":", 1)[0]
        port = start_store_server(world_size=num_proc) if rank == 0 else 0
        peers = [json.loads(m) for m in ctx.allGather(json.dumps({"host": host, "port": port}))]
        hosts = [p["host"] for p in peers]
        env = worker_env(topology_from_hosts(hosts, rank), hosts[0], int(peers[0]["port"]))
        env[ATTEMPT_ENV_VAR] = str(ctx.attemptNumber())
        env.update(user_env)
        with _task_environment(env, rank):
            try:
                fn, args, kwargs = cloudpickle.loads(payload)
                result = fn(*args, **kwargs)
            except BaseException as exc:
                if isinstance(exc, RingInternalError):
                    # A broken ring is usually the echo of another rank's failure: let that
                    # root cause fail the stage first, so it is the one the driver reports.
                    time.sleep(SECONDARY_FAILURE_DELAY_S)
                err = WorkerError.from_exception(rank, host, exc)
                raise RuntimeError(encode_worker_error(err)) from None
        yield cloudpickle.dumps((rank, result))

    return task
