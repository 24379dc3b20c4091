"""One rendezvous contract: the environment a launcher sets, and how a rank reads it.

A launcher (spark_runner, ray_runner, ringcore.testing, torchrun, Horovod's scripts)
only sets environment variables; :func:`read_environment` turns them into a
:class:`Rendezvous` — this rank's :class:`Topology` and where the job's key-value
store listens. Readers are tried in order; the first that recognises the
environment wins.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import _config as cfg
from .._errors import RendezvousError
from .topology import Topology

__all__ = [
    "TORCHRUN_VARS",
    "Rendezvous",
    "free_port",
    "read_environment",
    "torchrun_env",
    "worker_env",
]


@dataclass(frozen=True)
class Rendezvous:
    """Where this rank sits and where the job's store listens. ``is_store_host``: this
    process must host the store (rank 0 without an external host). ``superseded``: set
    only while an elastic ring re-forms (``ringcore.elastic.worker.rejoin``): why this
    ring's rendezvous is moot (a newer generation was published), or None; a rank
    waiting for its peers asks it about once a second and stops waiting on a reason."""

    topology: Topology
    store_addr: str
    store_port: int
    is_store_host: bool
    source: str
    superseded: Callable[[], str | None] | None = field(default=None, compare=False)


def worker_env(
    topology: Topology,
    store_addr: str,
    store_port: int,
    *,
    external_store: bool = False,
    secret: str | None = None,
) -> dict[str, str]:
    """The variables a launcher sets for one rank so that ``ringcore.init()`` needs nothing else.

    ``secret``: the job's secret (one per job, the same for every rank, e.g.
    ``secrets.token_hex(32)``); it authenticates the engine's control connections. Keep
    the returned dict out of logs. ``RING_STALL_SHUTDOWN_TIME_SECONDS`` is set too: the
    caller's own value, else 600 s (a stalled rank fails the job instead of hanging it).
    """
    env = {
        cfg.RANK_ENV_VAR: str(topology.rank),
        cfg.SIZE_ENV_VAR: str(topology.size),
        cfg.LOCAL_RANK_ENV_VAR: str(topology.local_rank),
        cfg.LOCAL_SIZE_ENV_VAR: str(topology.local_size),
        cfg.CROSS_RANK_ENV_VAR: str(topology.cross_rank),
        cfg.CROSS_SIZE_ENV_VAR: str(topology.cross_size),
        cfg.STORE_ADDR_ENV_VAR: store_addr,
        cfg.STORE_PORT_ENV_VAR: str(store_port),
        cfg.STORE_EXTERNAL_ENV_VAR: "1" if external_store else "0",
    }
    if topology.hosts:
        env[cfg.HOSTNAME_ENV_VAR] = topology.hosts[topology.rank]
    if secret:
        env[cfg.SECRET_KEY_ENV_VAR] = secret
    # bounded by default in launched jobs (Horovod's 0 would let one stalled rank hang
    # the job forever); the launcher's own environment or env= may set another value
    stall = cfg.get_env(cfg.STALL_SHUTDOWN_TIME_ENV_VAR)
    env[cfg.STALL_SHUTDOWN_TIME_ENV_VAR] = (
        stall or f"{cfg.DEFAULT_LAUNCHED_STALL_SHUTDOWN_TIME_S:g}"
    )
    return env


def _int_env(name: str, source: str) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise RendezvousError(
            f"{name}={raw!r} is not an integer; the {source} environment is incomplete. "
            f"Launch through spark_runner, ray_runner, torchrun or set {name}."
        ) from None


def _from_ring() -> Rendezvous | None:
    if cfg.get_env(cfg.RANK_ENV_VAR) is None or cfg.get_env(cfg.SIZE_ENV_VAR) is None:
        return None
    rank = int(cfg.get_env(cfg.RANK_ENV_VAR))  # type: ignore[arg-type]
    size = int(cfg.get_env(cfg.SIZE_ENV_VAR))  # type: ignore[arg-type]
    local_rank = int(cfg.get_env(cfg.LOCAL_RANK_ENV_VAR, "0"))  # type: ignore[arg-type]
    local_size = int(cfg.get_env(cfg.LOCAL_SIZE_ENV_VAR, "1"))  # type: ignore[arg-type]
    cross_rank = int(cfg.get_env(cfg.CROSS_RANK_ENV_VAR, str(rank)))  # type: ignore[arg-type]
    cross_size = int(cfg.get_env(cfg.CROSS_SIZE_ENV_VAR, str(size)))  # type: ignore[arg-type]
    topo = Topology(rank, size, local_rank, local_size, cross_rank, cross_size)
    addr = os.environ.get(cfg.STORE_ADDR_ENV_VAR) or os.environ.get("MASTER_ADDR")
    port = os.environ.get(cfg.STORE_PORT_ENV_VAR) or os.environ.get("MASTER_PORT")
    if size > 1 and (not addr or not port):
        raise RendezvousError(
            f"{cfg.RANK_ENV_VAR}/{cfg.SIZE_ENV_VAR} are set (rank {rank} of {size}) but "
            f"{cfg.STORE_ADDR_ENV_VAR}/{cfg.STORE_PORT_ENV_VAR} are not; set both to the "
            "address rank 0 can listen on."
        )
    external = os.environ.get(cfg.STORE_EXTERNAL_ENV_VAR, "0") == "1"
    return Rendezvous(
        topo, addr or "127.0.0.1", int(port or 0), rank == 0 and not external, "ringtrain"
    )


def _from_torchrun() -> Rendezvous | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    src = "torchrun"
    rank, size = _int_env("RANK", src), _int_env("WORLD_SIZE", src)
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    cross_rank = int(os.environ.get("GROUP_RANK", str(rank // max(local_size, 1))))
    cross_size = max(size // max(local_size, 1), 1)
    topo = Topology(rank, size, local_rank, local_size, cross_rank, cross_size)
    addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
    port = _int_env("MASTER_PORT", src) if size > 1 else 0
    # torchrun's agent hosts the store itself when it says so.
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    return Rendezvous(topo, addr, port, rank == 0 and not agent_store, src)


MPI_RANK_VARS = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def _from_mpi() -> Rendezvous | None:
    """Under ``mpirun`` (MPICH, Open MPI, MVAPICH): the topology comes from MPI itself."""
    if not any(v in os.environ for v in MPI_RANK_VARS):
        return None
    try:
        from mpi4py import MPI
    except ImportError:
        raise RendezvousError(
            "this process was launched by mpirun but mpi4py is not installed; "
            "pip install 'ringtrain[mpi]' (or unset the MPI variables to run without MPI)"
        ) from None
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    cross = comm.Split(local.Get_rank(), rank)
    topo = Topology(
        rank, size, local.Get_rank(), local.Get_size(), cross.Get_rank(), cross.Get_size()
    )
    local.Free()
    cross.Free()
    return Rendezvous(topo, "", 0, rank == 0, "mpi")


def _single_process() -> Rendezvous:
    return Rendezvous(Topology(0, 1, 0, 1, 0, 1), "127.0.0.1", 0, True, "single process")


READERS: list[Callable[[], Rendezvous | None]] = [_from_ring, _from_mpi, _from_torchrun]


def read_environment() -> Rendezvous:
    """This rank's rendezvous from the environment; a single process when none is set."""
    for reader in READERS:
        found = reader()
        if found is not None:
            return found
    return _single_process()


#: the variables torchrun sets for each worker, which :func:`torchrun_env` builds
TORCHRUN_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
)


def torchrun_env(
    topology: Topology, master_addr: str, master_port: int, run_id: str
) -> dict[str, str]:
    """The environment torchrun gives a worker, for the same rank as ringcore's
    host-major ``topology``: so ``torch.distributed.init_process_group()`` with no
    arguments (env://) forms the job's group, and Lightning, Accelerate and the Hugging
    Face Trainer see a torchelastic job. ``GROUP_RANK`` is the index of this rank's host
    (hosts in rank order; every rank of a host is consecutive), as torchrun's node rank.
    ``master_port``: a free port on rank 0's host for the user's own process group, never
    the job's store port (``free_port`` on that host)."""
    hosts: list[str] = []
    for h in topology.hosts:
        if h not in hosts:
            hosts.append(h)
    if hosts:
        group_rank, group_size = hosts.index(topology.hosts[topology.rank]), len(hosts)
    else:
        group_rank, group_size = topology.cross_rank, topology.cross_size
    return {
        "RANK": str(topology.rank),
        "WORLD_SIZE": str(topology.size),
        "LOCAL_RANK": str(topology.local_rank),
        "LOCAL_WORLD_SIZE": str(topology.local_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_size),
        "ROLE_RANK": str(topology.rank),
        "ROLE_WORLD_SIZE": str(topology.size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
    }


def free_port(host: str = "") -> int:
    """A TCP port free on this host now (bound to ``host``, then released), for a
    server that starts later: the user's ``MASTER_PORT``."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
