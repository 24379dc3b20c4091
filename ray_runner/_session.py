"""What a training loop sees inside a RingTrainer worker: report, get_checkpoint, get_context,
get_dataset_shard.

The driver sends a :class:`SessionSetup` with the loop; :func:`run_loop` opens the
session of this rank around the user's loop. ``report`` on rank 0 copies the
checkpoint into the run folder before it returns (so the loop may delete its own
copy at once) and queues the metrics; the driver drains that queue through the
actor's control method while the loop runs. Other ranks' reports are accepted and
dropped, as Ray Train keeps rank 0's.
"""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringcore import RingError, Topology, launch

from ._checkpoint import Checkpoint, CheckpointStore

__all__ = [
    "SessionSetup",
    "TrainContext",
    "drain_reports",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
    "run_loop",
]


@dataclass(frozen=True)
class TrainContext:
    """Where this worker sits in the run (Ray Train's ``TrainContext`` getters)."""

    world_rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    experiment_name: str
    storage_path: str

    def get_world_rank(self) -> int:
        return self.world_rank

    def get_world_size(self) -> int:
        return self.world_size

    def get_local_rank(self) -> int:
        return self.local_rank

    def get_local_world_size(self) -> int:
        return self.local_world_size

    def get_node_rank(self) -> int:
        return self.node_rank

    def get_experiment_name(self) -> str:
        return self.experiment_name

    def get_storage_path(self) -> str:
        """The run folder, ``<storage_path>/<name>``."""
        return self.storage_path


@dataclass(frozen=True)
class SessionSetup:
    """Plain data the driver sends with the loop for one attempt."""

    experiment_name: str
    run_dir: str
    num_to_keep: int | None
    restore: Checkpoint | None
    config: dict | None
    pass_config: bool
    elastic: bool = False
    datasets: dict[str, Any] | None = None  # this rank's shard of each dataset


@dataclass
class _Session:
    context: TrainContext
    restore: Checkpoint | None
    store: CheckpointStore
    setup: SessionSetup

    def current_context(self) -> TrainContext:
        """The context; in an elastic run it follows the ring's current generation."""
        return _elastic_context(self.setup) if self.setup.elastic else self.context


_lock = threading.Lock()
_session: _Session | None = None
_reports: queue.SimpleQueue = queue.SimpleQueue()


def _current(what: str) -> _Session:
    session = _session
    if session is None:
        raise RingError(
            f"ray_runner.{what}() was called outside a training loop; call it inside the "
            "train_loop_per_worker that RingTrainer(...).fit() runs"
        )
    return session


def _context_from(topology: Topology, setup: SessionSetup) -> TrainContext:
    nodes: list[str] = []
    for host in topology.hosts:
        if host not in nodes:
            nodes.append(host)
    node_rank = (
        nodes.index(topology.hosts[topology.rank]) if topology.hosts else topology.cross_rank
    )
    return TrainContext(
        world_rank=topology.rank,
        world_size=topology.size,
        local_rank=topology.local_rank,
        local_world_size=topology.local_size,
        node_rank=node_rank,
        experiment_name=setup.experiment_name,
        storage_path=setup.run_dir,
    )


def _elastic_context(setup: SessionSetup) -> TrainContext:
    """An elastic rank's place, read from the ``RING_*`` variables each generation sets."""
    env = os.environ
    if env.get(launch.ELASTIC_LATE_ENV_VAR) == "1":  # added, but not yet part of a ring
        rank, size, local_rank, local_size, cross_rank = -1, 0, -1, 0, -1
    else:
        rank, size = int(env[launch.RANK_ENV_VAR]), int(env[launch.SIZE_ENV_VAR])
        local_rank = int(env[launch.LOCAL_RANK_ENV_VAR])
        local_size = int(env[launch.LOCAL_SIZE_ENV_VAR])
        cross_rank = int(env[launch.CROSS_RANK_ENV_VAR])
    return TrainContext(
        world_rank=rank,
        world_size=size,
        local_rank=local_rank,
        local_world_size=local_size,
        node_rank=cross_rank,
        experiment_name=setup.experiment_name,
        storage_path=setup.run_dir,
    )


def run_loop(loop: Callable, setup: SessionSetup) -> Any:
    """Run the user's loop on this worker inside a session (executed by the worker actor)."""
    global _session
    from ._worker import current_topology

    session = _Session(
        _context_from(current_topology(), setup),
        setup.restore,
        CheckpointStore(setup.run_dir, setup.num_to_keep),
        setup,
    )
    with _lock:
        _session = session
    try:
        return loop(setup.config or {}) if setup.pass_config else loop()
    finally:
        with _lock:
            _session = None


def report(metrics: dict, checkpoint: Checkpoint | None = None) -> None:
    """Report this iteration's metrics (and, optionally, a checkpoint) to the driver.

    Every rank may call it; rank 0's metrics and checkpoint are kept. The checkpoint is
    copied into the run folder before ``report`` returns.
    """
    session = _current("report")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError(f"report(metrics) takes a dict with str keys, got {metrics!r}")
    if session.current_context().world_rank != 0:
        return
    persisted = session.store.persist(checkpoint) if checkpoint is not None else None
    _reports.put({"metrics": dict(metrics), "checkpoint": persisted})


def get_checkpoint() -> Checkpoint | None:
    """The checkpoint this attempt resumes from (the run's latest), or None on a fresh run."""
    return _current("get_checkpoint").restore


def get_context() -> TrainContext:
    """This worker's rank, world size, local rank, node rank, run name and folder."""
    return _current("get_context").current_context()


def get_dataset_shard(name: str = "train") -> Any:
    """This worker's shard of ``RingTrainer(datasets={name: ...})``: a Ray ``DataIterator``
    (``iter_batches``, ``iter_torch_batches``, ``iter_rows``); iterate it once per epoch
    on every worker."""
    session = _current("get_dataset_shard")
    shards = session.setup.datasets or {}
    if name not in shards:
        raise KeyError(
            f"no dataset named {name!r} was given to RingTrainer(datasets=...); "
            f"it has {sorted(shards)}"
        )
    return shards[name]


def drain_reports() -> list[dict]:
    out = []
    while True:
        try:
            out.append(_reports.get_nowait())
        except queue.Empty:
            return out
