"""What a training loop sees inside a RingTrainer worker: report, get_checkpoint, get_context,
get_dataset_shard.

The driver sends a :class:`SessionSetup` with the loop; :func:`run_loop` (called by the
rank's actor with the topology it was assigned) opens the session of this rank around
the user's loop. ``report`` on any rank uploads the
checkpoint it was given (if any) for ``checkpoint_<index>/`` on the run's storage
(rank 0 into the folder, others into a staging folder the driver merges) before it returns, so the loop may delete its own copy at once; the index is the
attempt's first free index plus the number of checkpoints this rank reported before,
so ranks that report checkpoints together fill the same folder (sharded checkpoints).
Rank 0 queues its metrics and files; every other rank publishes how far it got (its
report count and its files per index) in the job's key-value store, where rank 0's
actor reads it when the driver drains the queue. The driver commits a checkpoint once
every rank that reports checkpoints has passed that report (``_results``), so a rank
killed mid-upload never leaves a checkpoint that looks whole. Metrics of ranks other
than 0 are dropped, as Ray Train keeps rank 0's. In an elastic run only rank 0's
checkpoint is kept.
"""

from __future__ import annotations

import datetime
import json
import os
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ringcore import RingError, Topology, launch

from . import _constants as const
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
    filesystem: Any = None  # the run's pyarrow filesystem (None: local)
    next_index: int = 0  # this attempt's first checkpoint index
    attempt: str = ""  # this attempt's id: the key prefix in the job's store
    score_attribute: str | None = None  # CheckpointConfig.checkpoint_score_attribute


def peers_key(attempt: str, rank: int) -> str:
    return f"ray_runner/{attempt}/rank{rank}"


@dataclass
class _Session:
    context: TrainContext
    restore: Checkpoint | None
    store: CheckpointStore
    setup: SessionSetup
    reports: int = 0  # report() calls so far in this attempt
    shards: dict[int, list[str]] = field(default_factory=dict)  # index -> this rank's files
    client: Any = None  # this rank's client of the job's store (ranks other than 0)

    def current_context(self) -> TrainContext:
        """The context; in an elastic run it follows the ring's current generation."""
        return _elastic_context(self.setup) if self.setup.elastic else self.context


_lock = threading.Lock()
_session: _Session | None = None
_reports: queue.SimpleQueue = queue.SimpleQueue()
_peers_of: tuple[str, int] | None = None  # (attempt, world size) of the last fixed-group loop


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


def run_loop(loop: Callable, setup: SessionSetup, topology: Topology) -> Any:
    """Run the user's loop on this worker inside a session (``RingWorker.run_loop`` calls
    it with the ``topology`` the driver assigned to its actor)."""
    global _session
    session = _Session(
        _context_from(topology, setup),
        setup.restore,
        CheckpointStore(setup.run_dir, setup.num_to_keep, setup.filesystem),
        setup,
    )
    global _peers_of
    with _lock:
        _session = session
        if not setup.elastic:
            _peers_of = (setup.attempt, session.context.world_size)
    try:
        return loop(setup.config or {}) if setup.pass_config else loop()
    finally:
        with _lock:
            _session = None


def report(metrics: dict, checkpoint: Checkpoint | None = None) -> None:
    """Report this iteration's metrics (and, optionally, a checkpoint) to the driver.

    Every rank may call it and attach a checkpoint: each rank's files are uploaded into
    the same checkpoint folder (sharded checkpoints; where two ranks write the same file
    name, the lower rank's file is kept). Rank 0's metrics are kept. Ranks that report
    checkpoints should call ``report`` equally often, as in Ray Train.
    """
    session = _current("report")
    if not isinstance(metrics, dict) or not all(isinstance(k, str) for k in metrics):
        raise TypeError(f"report(metrics) takes a dict with str keys, got {metrics!r}")
    if checkpoint is not None and not isinstance(checkpoint, Checkpoint):
        raise TypeError(
            f"report(checkpoint=...) takes a ray_runner.Checkpoint, got {type(checkpoint).__name__}; "
            "wrap a directory with Checkpoint.from_directory(path)"
        )
    rank = session.current_context().world_rank
    setup = session.setup
    if setup.elastic:
        if rank == 0:
            _report_elastic(session, metrics, checkpoint)
        return
    session.reports += 1
    if rank == 0 and checkpoint is not None and setup.score_attribute:
        session.store.score_attribute = setup.score_attribute
        session.store.score(metrics)  # a missing score fails here, before the upload
    index = files = None
    if checkpoint is not None:
        index = setup.next_index + len(session.shards)
        files = session.store.upload(checkpoint, index, rank)
        session.shards[index] = files
    if rank == 0:
        _reports.put(
            {"report": session.reports, "metrics": dict(metrics), "index": index, "files": files}
        )
    else:
        _publish(session, rank)


def _report_elastic(session: _Session, metrics: dict, checkpoint: Checkpoint | None) -> None:
    """Rank 0 of an elastic ring: its checkpoint alone, at the run's next free index."""
    index = files = None
    if checkpoint is not None:
        if session.setup.score_attribute:
            session.store.score_attribute = session.setup.score_attribute
            session.store.score(metrics)
        index = max(session.store.next_index(), max(session.shards, default=-1) + 1)
        files = session.store.upload(checkpoint, index)
        session.shards[index] = files
    _reports.put({"report": 0, "metrics": dict(metrics), "index": index, "files": files})


def _store_client() -> Any:
    """A client of the job's key-value store (rank 0's actor hosts it)."""
    import torch.distributed as dist

    port = int(os.environ[launch.STORE_PORT_ENV_VAR])
    hosted = launch.hosted_store(port)
    if hosted is not None:
        return hosted
    timeout = launch.get_float(const.REPORT_TIMEOUT_ENV_VAR, const.DEFAULT_REPORT_TIMEOUT_S)
    return dist.TCPStore(
        os.environ[launch.STORE_ADDR_ENV_VAR],
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout),
    )


def _publish(session: _Session, rank: int) -> None:
    """This rank's progress, for rank 0's actor to hand the driver: reports made, files per index."""
    if launch.STORE_PORT_ENV_VAR not in os.environ:
        return
    if session.client is None:
        session.client = _store_client()
    state = {"report": session.reports, "shards": {str(i): f for i, f in session.shards.items()}}
    session.client.set(peers_key(session.setup.attempt, rank), json.dumps(state))


def peers_progress() -> dict[int, dict]:
    """On rank 0: every other rank's published progress (ranks that never reported are absent)."""
    if _peers_of is None or launch.STORE_PORT_ENV_VAR not in os.environ:
        return {}
    attempt, size = _peers_of
    if size <= 1:
        return {}
    store = _store_client()
    out = {}
    for rank in range(1, size):
        key = peers_key(attempt, rank)
        if store.check([key]):
            state = json.loads(store.get(key).decode())
            out[rank] = {
                "report": state["report"],
                "shards": {int(i): f for i, f in state["shards"].items()},
            }
    return out


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
    """Rank 0's queued reports; on rank 0 of a fixed group, then the others' progress
    as one last item ``{"peers": {rank: {"report": n, "shards": {index: files}}},
    "size": world size}`` (ranks that have not reported yet are absent)."""
    out = []
    while True:
        try:
            out.append(_reports.get_nowait())
        except queue.Empty:
            break
    try:
        peers = peers_progress()
    except (RuntimeError, OSError, ValueError):  # the store went away with the group
        peers = {}
    if _peers_of is not None and _peers_of[1] > 1:
        out.append({"peers": peers, "size": _peers_of[1]})
    return out
