"""The job's key-value store, hosted by the launcher (or rank 0) for as long as the job.

A launcher that starts the store itself, inside the rank-0 process and before the
user's function runs, knows its port before anyone connects: no port race between
picking a free port and binding it. Without a launcher's store (``horovodrun``-style
variables, ``torchrun`` without its agent store) rank 0's ``init()`` starts it here, on
the port the environment names (:func:`host_store`).

One store per process, kept until the process ends or :func:`stop_store_server`, never
closed by ``shutdown()``: the store outlives every ring formed through it. The other
ranks reconnect to it after a ``shutdown()`` in no order relative to rank 0's teardown;
a store closed and reopened by rank 0 on the same port let a faster rank's next
``init()`` connect to the closing one (and lose its connection), while rank 0 waited at
the new one until ``RING_START_TIMEOUT``. ``init()`` reuses it (:func:`hosted_store`)
instead of connecting to itself.
"""

from __future__ import annotations

import datetime
import threading

from .. import _config as cfg

__all__ = ["host_store", "hosted_store", "start_store_server", "stop_store_server"]

_server_lock = threading.Lock()
_server: object | None = None


def start_store_server(
    host: str = "0.0.0.0", world_size: int = 1, timeout_s: float | None = None
) -> int:
    """Start (once per process) the job's key-value store on a free port and return it."""
    with _server_lock:
        server = _server if _server is not None else _start(host, 0, world_size, timeout_s)
        return int(server.port)  # type: ignore[attr-defined]


def host_store(host: str, port: int, world_size: int, timeout_s: float) -> object:
    """This process's store on ``port``: the one it hosts there already, else a new one
    (a store this process hosts on another port belonged to an earlier job: dropped)."""
    with _server_lock:
        if _server is not None and int(_server.port) == port:  # type: ignore[attr-defined]
            return _server
        return _start(host, port, world_size, timeout_s)


def _start(host: str, port: int, world_size: int, timeout_s: float | None) -> object:
    global _server
    import torch.distributed as dist

    timeout = datetime.timedelta(
        seconds=timeout_s or cfg.get_float(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
    )
    _server = None  # close an earlier job's store before binding this one
    _server = dist.TCPStore(host, port, world_size, True, timeout=timeout, wait_for_workers=False)
    return _server


def hosted_store(port: int) -> object | None:
    """The store this process hosts on ``port``, if it started one."""
    with _server_lock:
        if _server is not None and int(_server.port) == port:  # type: ignore[attr-defined]
            return _server
    return None


def stop_store_server() -> None:
    """Drop this process's store (a reused process, e.g. a Spark Python worker, starts anew)."""
    global _server
    with _server_lock:
        _server = None
