"""The job's key-value store, hosted by the launcher (or rank 0) before any rank connects.

A launcher that starts the store itself, inside the rank-0 process and before the
user's function runs, knows its port before anyone connects: no port race between
picking a free port and binding it. One store per process; ``init()`` reuses it
(:func:`hosted_store`) instead of connecting to itself.
"""

from __future__ import annotations

import threading

from . import _config as cfg

__all__ = ["hosted_store", "start_store_server", "stop_store_server"]

_server_lock = threading.Lock()
_server: object | None = None


def start_store_server(
    host: str = "0.0.0.0", world_size: int = 1, timeout_s: float | None = None
) -> int:
    """Start (once per process) the job's key-value store on a free port and return it."""
    global _server
    import datetime

    import torch.distributed as dist

    with _server_lock:
        if _server is None:
            timeout = datetime.timedelta(
                seconds=timeout_s
                or cfg.get_float(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
            )
            _server = dist.TCPStore(
                host, 0, world_size, True, timeout=timeout, wait_for_workers=False
            )
        return int(_server.port)  # type: ignore[attr-defined]


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
