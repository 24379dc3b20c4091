"""Helpers for test fixtures that start a server process of their own (a Spark
standalone master, a Spark Connect server, a ``ray start --head``) on 127.0.0.1, and
``moto_s3_server()``: a real S3 API (moto's server mode) on 127.0.0.1, and ``local_ray()``:
one in-process Ray instance on 127.0.0.1 for a test module."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Callable, Iterator

#: the Ray instance a SHARED_RAY module started, left running for the next such module
_shared_ray = False


@contextlib.contextmanager
def local_ray(module_name: str, num_cpus: int = 2) -> Iterator[None]:
    """A local Ray instance with ``num_cpus`` CPUs on 127.0.0.1 (or the one already
    running, left running), with the test module ``module_name`` shipped to the actors
    by value (they cannot import it); shut down on exit, even after a failure.

    A module that marks itself ``SHARED_RAY = True`` leaves the instance running for
    the next such module (conftest.py runs them one after another and stops the
    instance, with :func:`stop_shared_ray`, before the first module not on it): the Ray
    start and its workers' cold imports are paid once."""
    import sys

    import ray

    global _shared_ray
    shared = bool(getattr(sys.modules[module_name], "SHARED_RAY", False))
    owns = not ray.is_initialized()
    if owns:
        ray.init(
            address="local",  # a new instance, never a `ray start` cluster found on the machine
            num_cpus=num_cpus,
            _node_ip_address="127.0.0.1",
            include_dashboard=False,
        )
        _shared_ray = shared
    elif shared and _shared_ray:
        assert ray.cluster_resources().get("CPU") == num_cpus, (
            f"the shared Ray instance has {ray.cluster_resources().get('CPU')} CPUs, this "
            f"module asks for {num_cpus}: give it its own (no SHARED_RAY)"
        )
    ray.cloudpickle.register_pickle_by_value(sys.modules[module_name])
    try:
        yield
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[module_name])
        if owns and not shared:
            ray.shutdown()


def stop_shared_ray() -> None:
    """Shuts down the instance a shared module started (a no-op otherwise)."""
    global _shared_ray
    if _shared_ray:
        _shared_ray = False
        import ray

        ray.shutdown()


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


#: what a client of :func:`moto_s3_server` passes: moto takes any key, and refuses none
S3_TEST_CREDENTIALS = {"key": "testing", "secret": "testing"}


@contextlib.contextmanager
def moto_s3_server() -> Iterator[dict[str, object]]:
    """A real S3 API on 127.0.0.1 (moto's ``ThreadedMotoServer``, in this process: Spark
    and Ray workers reach it over HTTP like any S3 endpoint), stopped on exit even when
    the test fails. Yields fsspec/s3fs ``storage_options`` for it: ``endpoint_url``
    plus dummy ``key``/``secret``; the endpoint alone is ``options["endpoint_url"]``.
    Buckets are made by the caller (``s3fs.S3FileSystem(**options).mkdir("bucket")``)."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # not a line per request
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield {"endpoint_url": f"http://127.0.0.1:{port}", **S3_TEST_CREDENTIALS}
    finally:
        server.stop()
