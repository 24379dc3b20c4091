"""Helpers for test fixtures that start a server process of their own (a Spark
standalone master, a Spark Connect server, a ``ray start --head``) on 127.0.0.1."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Callable


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_for_port(
    port: int,
    proc: subprocess.Popen,
    timeout_s: float,
    what: str,
    details: Callable[[], str] = str,
) -> None:
    """Return once something listens on 127.0.0.1:``port``; raise at once when ``proc``
    (``what``, which should open it) exited, or after ``timeout_s``. ``details()`` (the
    server's log, say) is added to the error."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}\n{details()}".rstrip())
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.2)
    raise TimeoutError(
        f"{what} did not listen on 127.0.0.1:{port} within {timeout_s} s\n{details()}".rstrip()
    )
