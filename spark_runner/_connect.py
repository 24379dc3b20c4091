"""``spark_runner.run`` on a Spark Connect session: the barrier stage as
``DataFrame.mapInArrow(..., barrier=True)``.

A Connect client holds no SparkContext, so there is no RDD to make a barrier stage of.
Instead a ``num_proc``-partition ``spark.range`` goes through ``mapInArrow`` in barrier
mode; each task runs the classic path's worker code (:func:`make_barrier_task`, which
gets its ``BarrierTaskContext`` the same way) and returns its pickled ``(rank, result)``
as rows ``(rank, chunk, data)`` of at most :data:`CHUNK_BYTES` each, so a large result
never becomes one oversized Arrow row; the driver joins the chunks in order.
``run_elastic`` wraps its (non-barrier) worker the same way (:func:`arrow_task`), one
single-task job per worker (``_slot_jobs``).

What differs from the classic path: the slot check reads ``spark.master`` and
``spark.task.cpus`` from ``spark.conf`` (other masters: one small probe job counts the
cluster's default parallelism; ``_slots``); cancellation is by an operation tag
(``spark.addTag`` / ``spark.interruptTag``) instead of a job group; the log server
listens on the client's address on the route to the Connect server. Stage retries: when
Spark retries failed tasks (``_slots.task_max_failures``: ``local[N,F]`` with F > 1, or on
a cluster manager ``spark.task.maxFailures`` > 1, default 4) the results go through a ``repartition(1)``, so the barrier stage is a shuffle map stage,
which Spark reruns as a whole (a failed barrier result stage is aborted); with no status
tracker on the client, :class:`AttemptCounter` numbers the attempts from the log
connections the tasks open (``RING_SPARK_ATTEMPT``). A failed task's error reaches the
client on its log connection when it has one, else in the Connect error text
(``ringcore.launch``'s worker-error codec).
"""

from __future__ import annotations

import contextlib
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ringcore import RingError
from ringcore.launch import find_worker_error

from ._slots import retries_configured
from ._task import TaskSpec, make_barrier_task

#: bytes of result per Arrow row: well under Connect's 4 MiB Arrow batches
#: (``spark.connect.grpc.arrow.maxBatchSize``) and gRPC's message limit
CHUNK_BYTES = 1 << 20
RESULT_SCHEMA = "rank int, chunk int, data binary"


class AttemptCounter:
    """``LogServer(attempt_of=...)`` for a Connect client, which has no status tracker:
    the attempt of a stage is the log connections seen so far for its stage id, divided
    by ``num_proc``. Each attempt's ``num_proc`` tasks connect once, at task start before
    ``fn`` runs, and Spark starts a retry only after every task of the failed attempt has
    ended, so the counts of two attempts never interleave. A task that failed before
    connecting shifts the count, so the ranks of an attempt may get two numbers; they
    take the largest (``_task.agreed_attempt``), which still grows from one attempt
    that ran to the next."""

    def __init__(self, num_proc: int):
        self._num_proc = num_proc
        self._seen: dict[int, int] = {}
        self._lock = threading.Lock()

    def __call__(self, stage_id: int) -> int:
        with self._lock:
            seen = self._seen.get(stage_id, 0)
            self._seen[stage_id] = seen + 1
        return seen // self._num_proc


def client_address(spark: Any) -> str:
    """This machine's address on the route to the Connect server (what its executors
    can reach, when they can reach the client at all). Sends nothing."""
    server = str(spark.client.host or "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((server, 9))  # a UDP "connect" only picks the route
            return str(probe.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def arrow_task(partition_task: Any):
    """The function given to ``mapInArrow``: ``partition_task`` (an RDD partition
    function, as the classic path gives ``mapPartitions``) over the ids of the
    partition's ``spark.range`` rows; its one result blob cut into ``(rank, chunk,
    data)`` rows, ``rank`` being the partition's index."""

    def task(batches: Iterator[Any]) -> Iterator[Any]:
        import pyarrow as pa
        from pyspark import TaskContext

        ids = [i for batch in batches for i in batch.column(0).to_pylist()]
        ctx = TaskContext.get()
        assert ctx is not None, "run inside a Spark task"
        rank = ctx.partitionId()
        blob = b"".join(partition_task(iter(ids)))
        schema = pa.schema([("rank", pa.int32()), ("chunk", pa.int32()), ("data", pa.binary())])
        for index, start in enumerate(range(0, max(len(blob), 1), CHUNK_BYTES)):
            data = [blob[start : start + CHUNK_BYTES]]
            yield pa.RecordBatch.from_arrays(
                [pa.array([rank], pa.int32()), pa.array([index], pa.int32()), pa.array(data)],
                schema=schema,
            )

    return task


def make_arrow_task(payload: bytes, spec: TaskSpec):
    """The function given to ``mapInArrow(..., barrier=True)``: the classic worker
    (:func:`make_barrier_task`), its one result blob cut into ``(rank, chunk, data)`` rows."""
    return arrow_task(make_barrier_task(payload, spec))


def reassemble(table: Any, num_proc: int) -> list[bytes]:
    """One blob per rank, ordered by rank, from the ``(rank, chunk, data)`` rows."""
    pieces: dict[int, dict[int, bytes]] = {}
    for rank, chunk, data in zip(
        table.column("rank").to_pylist(),
        table.column("chunk").to_pylist(),
        table.column("data").to_pylist(),
    ):
        pieces.setdefault(int(rank), {})[int(chunk)] = data
    if sorted(pieces) != list(range(num_proc)):
        raise RingError(f"expected results from ranks 0..{num_proc - 1}, got {sorted(pieces)}")
    blobs = []
    for rank in range(num_proc):
        chunks = pieces[rank]
        if sorted(chunks) != list(range(len(chunks))):
            raise RingError(f"rank {rank}'s result came back with chunks missing")
        blobs.append(b"".join(chunks[i] for i in range(len(chunks))))
    return blobs


def run_stage(
    spark: Any, payload: bytes, spec: TaskSpec, server: Any, profile: Any = None
) -> list[bytes]:
    """The barrier stage under its own operation tag; interrupted if anything stops it.
    ``profile``: the stage's task ResourceProfile (``mapInArrow(profile=)``, pyspark >= 4.0),
    already taken by the server (``spark_runner._resources``).
    A failed task's error comes from the log server ``server`` when the task reached it,
    else from the Connect error text."""
    num_proc = spec.num_proc
    tag = f"ringtrain-{uuid.uuid4().hex[:12]}"
    spark.addTag(tag)
    try:
        retried = retries_configured(
            str(spark.conf.get("spark.master", "")), spark.conf.get("spark.task.maxFailures", None)
        )
        with_profile = {} if profile is None else {"profile": profile}
        frame = spark.range(0, num_proc, 1, num_proc).mapInArrow(
            make_arrow_task(payload, replace(spec, all_or_none=retried)),
            RESULT_SCHEMA,
            barrier=True,
            **with_profile,
        )
        if retried:  # Spark reruns a failed barrier stage only before a shuffle
            frame = frame.repartition(1)
        table = frame.toArrow()
    except BaseException as exc:
        with contextlib.suppress(Exception):  # a dead server has nothing left to stop
            spark.interruptTag(tag)  # no task, and no Python worker, outlives the call
        if not isinstance(exc, Exception):
            raise
        server.drain()  # every task's error and last lines are in
        worker_error = find_worker_error(str(exc), server, spec.secret)
        if worker_error is not None:
            raise worker_error from None
        raise RingError(
            f"the Spark barrier stage of {num_proc} tasks (Spark Connect) failed: {exc}"
        ) from exc
    finally:
        spark.removeTag(tag)
    return reassemble(table, num_proc)
