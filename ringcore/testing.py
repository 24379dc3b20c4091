"""``run_workers(fn, np=2)``: run a function on ``np`` local ranks over Gloo on 127.0.0.1.

The parent process hosts the job's store (a coordinator that outlives every rank),
starts one spawned process per rank with the rendezvous environment set, and
returns each rank's result ordered by rank — or raises :class:`WorkerError` with
the first failing rank's traceback after ending the other ranks.
"""

from __future__ import annotations

import datetime
import multiprocessing
import os
import time
from multiprocessing.connection import wait
from typing import Any

import cloudpickle

from ._errors import RingError, WorkerError
from ._rendezvous import worker_env
from ._topology import topology_from_hosts

__all__ = ["run_workers"]

_LOOPBACK = "127.0.0.1"


def _child(payload: bytes, env: dict[str, str], conn: Any) -> None:
    os.environ.update(env)
    rank = int(env["RING_RANK"])
    try:
        fn, args, kwargs = cloudpickle.loads(payload)
        result = fn(*args, **kwargs)
        conn.send(("ok", cloudpickle.dumps(result)))
    except BaseException as exc:
        conn.send(
            (
                "error",
                cloudpickle.dumps(
                    WorkerError.from_exception(rank, env.get("RING_HOSTNAME", _LOOPBACK), exc)
                ),
            )
        )
    finally:
        from . import _runtime

        _runtime.shutdown()
        conn.close()


def _end(procs: list[Any], grace_s: float = 3.0) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(1.0)


def run_workers(
    fn,
    np: int = 2,
    args: tuple = (),
    kwargs: dict | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120.0,
    hosts: list[str] | None = None,
    return_exceptions: bool = False,
    elastic: bool = False,
    min_np: int = 1,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``np`` ranks and return the results by rank.

    ``hosts`` fakes the host of every rank (to test local/cross ranks); every process
    still runs on this machine and talks over 127.0.0.1. With ``return_exceptions``,
    a failed rank's :class:`WorkerError` takes its place in the list (as in
    ``asyncio.gather``) and the other ranks run on; otherwise the first failure ends
    every rank and is raised.

    With ``elastic``, this process is the job's elastic coordinator: when a rank dies
    (or the ranks ask for it), it publishes a new generation of the ring with the
    workers still alive, and ``ringcore.torch.elastic.run`` re-forms the ring on them;
    results are indexed by the original rank, a dead worker's entry is its
    :class:`WorkerError` (``return_exceptions`` is implied).
    """
    return_exceptions = return_exceptions or elastic
    if np < 1:
        raise ValueError(f"np must be >= 1, got {np}")
    hosts = list(hosts) if hosts is not None else [_LOOPBACK] * np
    if len(hosts) != np:
        raise ValueError(f"hosts lists {len(hosts)} entries but np is {np}")
    import torch.distributed as dist

    store = dist.TCPStore(
        _LOOPBACK, 0, np, True, timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False
    )
    ctx = multiprocessing.get_context("spawn")
    payload = cloudpickle.dumps((fn, args, kwargs or {}))
    procs, conns = [], []
    for r in range(np):
        rank_env = worker_env(
            topology_from_hosts(hosts, r), _LOOPBACK, store.port, external_store=True
        )
        if elastic:
            rank_env.update({"RING_ELASTIC": "1", "RING_WORKER_ID": str(r)})
        rank_env.update(env or {})
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_child, args=(payload, rank_env, child_conn), daemon=True, name=f"ring-rank-{r}"
        )
        p.start()
        child_conn.close()
        procs.append(p)
        conns.append(parent_conn)
    results: dict[int, Any] = {}
    driver = None
    if elastic:
        from ._elastic import ElasticDriver

        def alive() -> tuple[list[str], list[str]]:
            # a worker that returned its result is done, not lost
            live = [
                r
                for r, p in enumerate(procs)
                if p.is_alive() or (r in results and not isinstance(results[r], WorkerError))
            ]
            return [str(r) for r in live], [hosts[r] for r in live]

        driver = ElasticDriver(store, alive, min_workers=min_np)
        driver.start([str(r) for r in range(np)])
    try:
        deadline = time.monotonic() + timeout
        pending = dict(enumerate(conns))
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RingError(
                    f"run_workers timed out after {timeout:.0f} s; ranks {sorted(pending)} had not "
                    "returned. Raise timeout= or look for a rank that waits on a collective the others skipped."
                )
            ready = wait(
                list(pending.values()) + [procs[r].sentinel for r in pending],
                timeout=min(left, 0.2 if driver else 1.0),
            )
            if driver is not None:
                driver.poll()
            for r, conn in list(pending.items()):
                if conn in ready or procs[r].sentinel in ready:
                    try:
                        kind, data = conn.recv()
                        value = cloudpickle.loads(data)
                    except EOFError:
                        procs[r].join(5.0)
                        kind, value = (
                            "error",
                            WorkerError(
                                r,
                                hosts[r],
                                "ProcessExit",
                                f"the process exited with code {procs[r].exitcode} before returning",
                            ),
                        )
                    del pending[r]
                    if kind == "error" and not return_exceptions:
                        raise value
                    results[r] = value
    finally:
        _end(procs)
        del store
    return [results[r] for r in range(np)]
