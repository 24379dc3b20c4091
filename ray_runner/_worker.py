"""One rank of a RayExecutor or RingTrainer: the actor class.

The driver creates one :class:`RingWorker` actor per rank, asks each for its node's
IP, assigns ranks, asks rank 0 to host the job's store and to pick a free port for
the user's own process group (``MASTER_PORT``), then hands every actor the ``RING_*``
environment of its rank (:func:`ringcore.worker_env`) and torchrun's
(:func:`ringcore.launch.torchrun_env`). After that, ``ringcore.init()`` inside any
function the actor runs forms the ring unchanged, and so does a ``torch.distributed``
program's ``init_process_group()`` (env://).

An actor runs many user calls (``RayExecutor.run`` after ``run``): before each one it
installs the guard on ``init_process_group`` (one process group per job, whoever forms
it first), and after each one it ends a process group the user's code left behind
(Lightning and the Hugging Face Trainer never destroy theirs), so the next call starts
with none (:func:`ringcore.launch.release_user_group`).

User-code exceptions never leave an actor as Ray exceptions: :meth:`RingWorker.run`
returns an envelope, ``("ok", value)`` or ``("error", WorkerError)``, and the driver
re-raises the :class:`ringcore.WorkerError` itself, so Ray's ``RayTaskError``
wrapping cannot hide the rank, host and traceback.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import ray

import ringcore
from ringcore import Topology, WorkerError
from ringcore.launch import free_port, install_init_guard, release_user_group

from . import _logger, _session
from ._envelopes import Envelope

__all__ = ["CONTROL_GROUP", "RingWorker"]

# Calls that must be served while the default group runs the user's function.
CONTROL_GROUP = "control"


class RingWorker:
    """The actor behind one rank. Subclass and set ``RayExecutor.worker_cls`` to inject behaviour."""

    def __init__(self) -> None:
        self.rank = -1
        self.topology: Topology | None = None  # the driver assigns it in setup()
        self.host = ray.util.get_node_ip_address()
        self.executable: Any = None
        _logger.enable()  # ray_logger.log in this process queues for the driver

    def node_ip(self) -> str:
        return self.host

    def node(self) -> tuple[str, str]:
        """This actor's node: its IP and its Ray node id."""
        return self.host, ray.get_runtime_context().get_node_id()

    def gpu_ids(self) -> list:
        return list(ray.get_gpu_ids())

    def update_env(self, env: dict[str, str]) -> None:
        os.environ.update(env)

    def start_store(self, world_size: int) -> Envelope:
        """Host the job's key-value store in this (rank 0) process; the envelope holds its port."""
        return self._guard(ringcore.start_store_server, host="0.0.0.0", world_size=world_size)

    def master_port(self) -> Envelope:
        """A port free on this (rank 0's) node for the user's process group: ``MASTER_PORT``."""
        return self._guard(free_port)

    def prepare_ring(self) -> Envelope:
        """Load the ring's transport (torch.distributed) now, alongside rank 0's store start."""

        def load() -> None:
            import torch.distributed  # noqa: F401

        return self._guard(load)

    def setup(
        self,
        topology: Topology,
        env: dict[str, str],
        executable_cls: type | None = None,
        executable_args: tuple = (),
        executable_kwargs: dict | None = None,
    ) -> Envelope:
        self.rank = topology.rank
        self.topology = topology
        os.environ.update(env)
        if executable_cls is None:
            return ("ok", None)

        def make() -> None:
            self.executable = executable_cls(*executable_args, **(executable_kwargs or {}))

        return self._guard(make)

    def run(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Envelope:
        return self._guard(_user_code, fn, *args, **(kwargs or {}))

    def run_loop(self, loop: Callable, setup: _session.SessionSetup) -> Envelope:
        """A RingTrainer loop inside this rank's session (``_session.run_loop``), on the
        topology :meth:`setup` assigned."""

        def run() -> Any:
            if self.topology is None:
                raise ringcore.RingError(
                    "this worker has no topology yet; the driver calls setup() before run_loop()"
                )
            return _user_code(_session.run_loop, loop, setup, self.topology)

        return self._guard(run)

    def execute(self, fn: Callable) -> Envelope:
        return self._guard(_user_code, fn, self.executable)

    def run_raising(self, fn: Callable, args: tuple = (), kwargs: dict | None = None) -> Any:
        """For ``run_remote``: raise the WorkerError (Ray wraps it, as an instance of it)."""
        kind, value = self.run(fn, args, kwargs)
        if kind == "error":
            raise value
        return value

    @ray.method(concurrency_group=CONTROL_GROUP)
    def ping(self) -> bool:
        """Answers while the function runs: the driver's check that this actor lives."""
        return True

    @ray.method(concurrency_group=CONTROL_GROUP)
    def drain_reports(self) -> list[dict]:
        """Everything ``ray_runner.report`` queued in this process since the last call."""
        return _session.drain_reports()

    @ray.method(concurrency_group=CONTROL_GROUP)
    def drain_logs(self) -> list:
        """Everything ``ray_runner.ray_logger.log`` queued in this process since the last call."""
        return _logger.drain()

    def _guard(self, fn: Callable, /, *args: Any, **kwargs: Any) -> Envelope:
        try:
            return ("ok", fn(*args, **kwargs))
        except BaseException as exc:  # a worker's sys.exit must reach the driver too
            return ("error", WorkerError.from_exception(self.rank, self.host, exc))


def _user_code(fn: Callable, /, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` with the guard on ``init_process_group`` installed, and no
    process group of the user's left behind for the actor's next call."""
    install_init_guard()
    try:
        return fn(*args, **kwargs)
    finally:
        release_user_group()
