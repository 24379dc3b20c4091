"""Lifecycle and topology of this process: ``init()``, ``shutdown()``, ``rank()``, ...

``init()`` reads the rendezvous from the environment (see ``_rendezvous``), opens
the job's store and the backend's process group. The backend is Gloo through
``torch.distributed``; torch is imported here only when ``init()`` runs, so
``import ringcore`` stays light.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any

from . import _config as cfg
from ._auth import job_secret, new_secret
from ._errors import NotInitializedError, RendezvousError
from ._rendezvous import Rendezvous, hosted_store, read_environment
from ._timeline import Timeline
from ._topology import Topology

log = logging.getLogger("ringtrain.ringcore")

__all__ = [
    "cross_rank",
    "cross_size",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "rank",
    "shutdown",
    "size",
]


@dataclass
class _State:
    topology: Topology
    rendezvous: Rendezvous
    store: Any
    owns_process_group: bool
    engine: Any = None
    coordinator: Any = None
    dynamic_process_sets: bool = False


_lock = threading.RLock()
_state: _State | None = None
_generation = 0
_timeline = Timeline()
_atexit_registered = False


def _is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("localhost", "::1")


def _open_store(rdv: Rendezvous, timeout: datetime.timedelta) -> Any:
    import torch.distributed as dist

    if rdv.topology.size == 1 and rdv.store_port == 0:
        return dist.HashStore()
    hosted = hosted_store(rdv.store_port)
    if hosted is not None:
        return hosted
    try:
        return dist.TCPStore(
            rdv.store_addr,
            rdv.store_port,
            rdv.topology.size,
            rdv.is_store_host,
            timeout=timeout,
            wait_for_workers=False,
        )
    except Exception as exc:  # torch raises RuntimeError / DistStoreError / TimeoutError
        role = "host" if rdv.is_store_host else "reach"
        raise RendezvousError(
            f"rank {rdv.topology.rank} could not {role} the job's store at "
            f"{rdv.store_addr}:{rdv.store_port} within {timeout.total_seconds():.0f} s "
            f"({type(exc).__name__}: {exc}). Check that rank 0 started and that the port is "
            f"reachable, or raise {cfg.START_TIMEOUT_ENV_VAR}."
        ) from exc


def _await_ranks(store: Any, rdv: Rendezvous, timeout: datetime.timedelta) -> None:
    """Every rank checks in at the store; when one never arrives, the others fail
    within ``timeout`` with a message naming it (not the backend's own timeout)."""
    topo = rdv.topology
    if topo.size == 1:
        return
    keys = [f"arrived/{r}" for r in range(topo.size)]
    store.set(keys[topo.rank], "1")
    try:
        store.wait(keys, timeout)
        return
    except Exception:  # torch raises DistStoreError / RuntimeError on timeout
        missing = [r for r, key in enumerate(keys) if not store.check([key])]
    if not missing:
        return
    raise RendezvousError(
        f"rank {topo.rank} of {topo.size}: ranks {missing} did not arrive at the rendezvous "
        f"(store {rdv.store_addr}:{rdv.store_port}) within {timeout.total_seconds():.0f} s. "
        f"Check that those ranks started (see their output), or raise {cfg.START_TIMEOUT_ENV_VAR}."
    ) from None


def init(comm: Any = None, process_sets: Any = None) -> None:
    """Join the job described by the environment. Idempotent; works again after shutdown().

    ``process_sets``: a list of :class:`ProcessSet` to register on every rank, or
    ``"dynamic"`` to allow ``add_process_set``/``remove_process_set`` later.
    """
    if comm is not None:
        raise NotImplementedError(
            "init(comm=...) is not supported yet: ringcore always spans every launched rank. "
            "Use process_sets=[ProcessSet(ranks)] to run collectives on a subset."
        )
    if (
        process_sets is not None
        and process_sets != "dynamic"
        and not isinstance(process_sets, list | tuple)
    ):
        raise TypeError(
            f"process_sets must be a list of ProcessSet or 'dynamic', got {process_sets!r}"
        )
    with _lock:
        _init_locked(process_sets)


def _apply_log_level() -> None:
    """``RING_LOG_LEVEL`` (trace/debug/info/warning/error/fatal): the level of the
    ``ringtrain`` loggers; with no handler configured, lines go to stderr tagged by rank."""
    value = cfg.get_env(cfg.LOG_LEVEL_ENV_VAR)
    if not value:
        return
    level = cfg.LOG_LEVELS.get(value.strip().lower())
    if level is None:
        raise ValueError(
            f"{cfg.LOG_LEVEL_ENV_VAR}={value!r} is not a log level; use one of "
            f"{', '.join(cfg.LOG_LEVELS)} (or unset it)"
        )
    root = logging.getLogger("ringtrain")
    root.setLevel(level)
    if not root.handlers and not logging.getLogger().handlers:
        handler = logging.StreamHandler()
        rank = os.environ.get(cfg.RANK_ENV_VAR, "?")
        handler.setFormatter(
            logging.Formatter(f"[%(asctime)s] [{rank}] %(levelname)s %(name)s: %(message)s")
        )
        root.addHandler(handler)


def _init_locked(process_sets: Any) -> None:
    global _state, _generation, _atexit_registered
    if _state is not None:
        return
    import torch.distributed as dist

    if not _atexit_registered:
        # Registered after torch's import, so it runs before torch's own exit handlers:
        # a script that never calls shutdown() still leaves the ring in order, and the
        # process group's threads are stopped before the interpreter tears down C++ state
        # (otherwise: "terminate called without an active exception", SIGABRT).
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True

    _apply_log_level()

    if os.environ.get("RING_ELASTIC_LATE") == "1":  # added to a running elastic job
        from ._elastic import join_late

        join_late()
        os.environ["RING_ELASTIC_LATE"] = "0"
    rdv = read_environment()
    topo = rdv.topology
    backend_name = (
        cfg.get_env(cfg.BACKEND_ENV_VAR) or ("mpi" if rdv.source == "mpi" else cfg.DEFAULT_BACKEND)
    ).lower()
    if backend_name not in ("gloo", "nccl", "mpi"):
        raise ValueError(
            f"{cfg.BACKEND_ENV_VAR}={backend_name!r} is not a backend; use 'gloo', 'nccl' or 'mpi'."
        )
    if backend_name == "mpi":
        if rdv.source != "mpi":
            raise RendezvousError(
                f"{cfg.BACKEND_ENV_VAR}=mpi needs the job to be launched by mpirun (no MPI environment found)"
            )
        from ._backends import HostStaged, MPIBackend

        _state = _State(topo, rdv, None, owns_process_group=False)
        try:
            _start_engine(_state, process_sets, HostStaged(MPIBackend()))
        except BaseException:
            _state = None
            raise
        return
    if rdv.source == "mpi":
        rdv = _gloo_under_mpi(rdv)
    start_timeout = datetime.timedelta(
        seconds=cfg.get_float(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
    )
    op_timeout = datetime.timedelta(
        seconds=cfg.get_float(cfg.GLOO_TIMEOUT_ENV_VAR, cfg.DEFAULT_GLOO_TIMEOUT_S)
    )
    if dist.is_initialized():
        # Someone (a torchrun script, a test) already formed the default group: adopt it.
        if dist.get_world_size() != topo.size or dist.get_rank() != topo.rank:
            raise RendezvousError(
                f"torch.distributed is already initialized as rank {dist.get_rank()} of "
                f"{dist.get_world_size()}, but the environment says rank {topo.rank} of "
                f"{topo.size}. Destroy that process group first or fix the environment."
            )
        _state = _State(topo, rdv, None, owns_process_group=False)
        try:
            _start_engine(_state, process_sets, _torch_backend())
        except BaseException:
            _state = None
            raise
        return
    from . import _iface

    # A store *named* by a hostname that resolves to loopback here only (rank 0's own
    # name in /etc/hosts) must not put a multi-host ring on lo; a literal 127.x is local.
    spans_hosts = topo.local_size < topo.size and not _is_loopback(rdv.store_addr)
    iface = _iface.apply(rdv.store_addr, rdv.store_port, spans_hosts)
    store = _open_store(rdv, start_timeout)
    _generation += 1
    prefix = os.environ.get(cfg.STORE_PREFIX_ENV_VAR) or f"ringcore/{_generation}"
    prefixed = dist.PrefixStore(prefix, store)
    _await_ranks(prefixed, rdv, start_timeout)
    from ._gpu import plan  # gloo, or cpu:gloo,cuda:nccl with this rank's GPU pinned

    backend = plan(topo, prefixed).process_group or "gloo"
    try:
        dist.init_process_group(
            backend, store=prefixed, rank=topo.rank, world_size=topo.size, timeout=op_timeout
        )
    except Exception as exc:
        raise RendezvousError(
            f"rank {topo.rank} of {topo.size} could not form the {backend} ring through "
            f"{rdv.store_addr}:{rdv.store_port} ({type(exc).__name__}: {exc}). This rank's "
            f"data plane is on interface {iface.name or 'chosen by Gloo'} ({iface.reason}): "
            f"if peers cannot reach it, set {cfg.IFACE_ENV_VAR} to the interface that "
            "reaches the other hosts, and let TCP between the hosts through (docs/cluster.md)."
        ) from exc
    _state = _State(topo, rdv, store, owns_process_group=True)
    try:
        _start_engine(_state, process_sets, _torch_backend())
    except BaseException:
        _teardown(_state)
        _state = None
        raise
    log.debug("rank %d/%d joined through %s", topo.rank, topo.size, rdv.source)


def _advertised_address(rdv: Rendezvous) -> str:
    """Where rank 0's coordinator is reached: an address on the route, never merely what
    the hostname resolves to (often 127.0.1.1 on a real cluster)."""
    import socket

    from . import _iface

    host = os.environ.get(cfg.HOSTNAME_ENV_VAR)
    if rdv.source.startswith("mpi"):
        single_host = rdv.topology.local_size == rdv.topology.size
        if host:
            return host
        return "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
    if rdv.store_addr and (rdv.is_store_host or _is_loopback(rdv.store_addr)):
        return rdv.store_addr
    if host and not _resolves_to_loopback(host):
        return host
    route = _iface.route_address(rdv.store_addr, rdv.store_port) if rdv.store_addr else None
    return route or host or socket.gethostbyname(socket.gethostname())


def _resolves_to_loopback(host: str) -> bool:
    import socket

    if _is_loopback(host):
        return True
    try:
        return _is_loopback(socket.gethostbyname(host))
    except OSError:
        return False


def _torch_backend() -> Any:
    from ._backends import torch_backend

    return torch_backend()


def _gloo_under_mpi(rdv: Rendezvous) -> Rendezvous:
    """Gloo chosen under mpirun: rank 0 hosts the store; MPI tells everyone where."""
    import socket
    from dataclasses import replace

    from mpi4py import MPI

    from ._rendezvous import start_store_server

    comm = MPI.COMM_WORLD
    single_host = rdv.topology.local_size == rdv.topology.size
    addr = "127.0.0.1" if single_host else socket.gethostbyname(socket.gethostname())
    port = start_store_server(world_size=rdv.topology.size) if rdv.topology.rank == 0 else 0
    addr, port = comm.bcast((addr, port), root=0)
    return replace(rdv, store_addr=addr, store_port=port, source="mpi+gloo")


def _start_engine(state: _State, process_sets: Any, backend: Any) -> None:
    from ._coordinator import Coordinator, CoordinatorConfig
    from ._engine import Engine

    topo = state.topology
    timeout = cfg.get_float(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
    secret = job_secret()
    offer: dict[str, Any] = {}
    if topo.rank == 0:
        conf = CoordinatorConfig(
            size=topo.size,
            fusion_threshold=cfg.get_int(
                cfg.FUSION_THRESHOLD_ENV_VAR, cfg.DEFAULT_FUSION_THRESHOLD
            ),
            cycle_time_s=cfg.get_float(cfg.CYCLE_TIME_ENV_VAR, cfg.DEFAULT_CYCLE_TIME_MS) / 1000.0,
            cache_capacity=cfg.get_int(cfg.CACHE_CAPACITY_ENV_VAR, cfg.DEFAULT_CACHE_CAPACITY),
            stall_check_s=cfg.get_float(
                cfg.STALL_CHECK_TIME_ENV_VAR, cfg.DEFAULT_STALL_CHECK_TIME_S
            ),
            stall_shutdown_s=cfg.get_float(
                cfg.STALL_SHUTDOWN_TIME_ENV_VAR, cfg.DEFAULT_STALL_SHUTDOWN_TIME_S
            ),
            stall_check_enabled=not cfg.get_bool(cfg.STALL_CHECK_DISABLE_ENV_VAR),
            autotune=cfg.get_bool(cfg.AUTOTUNE_ENV_VAR),
            autotune_log=cfg.get_env(cfg.AUTOTUNE_LOG_ENV_VAR),
            start_timeout_s=timeout,
        )
        advertised = _advertised_address(state.rendezvous)
        made = None if secret else new_secret()
        state.coordinator = Coordinator(
            conf,
            secret=secret or made,  # type: ignore[arg-type]
            host="127.0.0.1" if _is_loopback(advertised) else "0.0.0.0",
        )
        state.coordinator.start()
        # Without RING_SECRET_KEY rank 0's fresh secret goes to the ranks over the
        # backend (Gloo's connections, never the store); see "Trust model".
        offer = {"addr": f"{advertised}:{state.coordinator.port}", "secret": made}
    offer = backend.broadcast_object(offer, 0)
    host, port = offer["addr"].rsplit(":", 1)
    secret = offer["secret"] or secret
    if secret is None:
        raise RendezvousError(
            f"rank {topo.rank}: rank 0 has {cfg.SECRET_KEY_ENV_VAR} set but this rank has not. "
            f"Launch every rank with the same {cfg.SECRET_KEY_ENV_VAR}, or unset it everywhere."
        )
    state.engine = Engine(
        backend,
        topo.rank,
        topo.size,
        (host, int(port)),
        _timeline,
        connect_timeout_s=timeout,
        cycle_time_s=cfg.get_float(cfg.CYCLE_TIME_ENV_VAR, cfg.DEFAULT_CYCLE_TIME_MS) / 1000.0,
        secret=secret,
    )
    state.dynamic_process_sets = process_sets == "dynamic" or cfg.get_bool(
        cfg.DYNAMIC_PROCESS_SETS_ENV_VAR
    )
    path = cfg.get_env(cfg.TIMELINE_ENV_VAR)
    # "DYNAMIC" (Horovod's spelling): no file at start-up, start_timeline() later
    if path and path.upper() != "DYNAMIC" and topo.rank == 0 and not _timeline.active:
        _timeline.start(path, mark_cycles=cfg.get_bool(cfg.TIMELINE_MARK_CYCLES_ENV_VAR))
    if isinstance(process_sets, list | tuple):
        from ._process_sets import register_process_set

        for ps in process_sets:
            register_process_set(ps)


def _teardown(state: _State) -> None:
    from . import _iface

    if state.engine is not None:
        state.engine.close()
    if state.coordinator is not None:
        state.coordinator.thread.join(timeout=30.0)
    _timeline.stop()
    if state.owns_process_group:
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception as exc:  # a dead peer must not make shutdown fail
                log.debug("destroy_process_group failed: %s", exc)
        _iface.restore()


def shutdown() -> None:
    """Leave the job; ``init()`` may be called again afterwards."""
    global _state
    with _lock:
        if _state is None:
            return
        state, _state = _state, None
        _teardown(state)


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception as exc:  # the process is exiting: say why, never raise
        log.warning("shutdown at interpreter exit failed: %s: %s", type(exc).__name__, exc)


def engine() -> Any:
    state = _state
    if state is None:
        raise NotInitializedError()
    return state.engine


def backend_name() -> str | None:
    """The data-plane backend of the running job ("gloo", "mpi", ...), None before init()."""
    state = _state
    return None if state is None or state.engine is None else state.engine.backend.name


def dynamic_process_sets_enabled() -> bool:
    state = _state
    return bool(state and state.dynamic_process_sets)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline of every op to ``file_path`` (rank 0 writes it)."""
    if rank() == 0:
        _timeline.start(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    _timeline.stop()


def is_initialized() -> bool:
    return _state is not None


def topology() -> Topology:
    state = _state
    if state is None:
        raise NotInitializedError()
    return state.topology


def rank() -> int:
    return topology().rank


def size() -> int:
    return topology().size


def local_rank() -> int:
    return topology().local_rank


def local_size() -> int:
    return topology().local_size


def cross_rank() -> int:
    return topology().cross_rank


def cross_size() -> int:
    return topology().cross_size


def is_homogeneous() -> bool:
    return topology().is_homogeneous
