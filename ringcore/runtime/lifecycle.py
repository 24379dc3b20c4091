"""Lifecycle of this process in a job: ``init()`` and ``shutdown()``.

``init()`` reads the rendezvous from the environment (``ringcore.rendezvous``), joins
the ring through the backend registered under ``RING_BACKEND`` (``ringcore.backends``),
puts the host's shared-memory plane in front of that backend where it applies
(``ringcore.shm.layer``: any backend whose connection came with the ring's store),
starts the coordinator (rank 0) and this rank's engine, and publishes the result as
the runtime state (``state``), which the layers above read. torch is imported here only
when ``init()`` runs, so ``import ringcore`` stays light.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import socket
from typing import Any

from .. import _config as cfg
from .._auth import job_secret, new_secret
from .._errors import RendezvousError
from ..backends.protocol import Backend, Connection
from ..backends.registry import lookup_backend, requested_backend
from ..elastic import worker as elastic_worker
from ..engine.coordinator import Coordinator, CoordinatorConfig
from ..rendezvous import iface
from ..rendezvous.environment import Rendezvous, read_environment
from ..rendezvous.iface import is_loopback
from . import state as _st
from .heap import freeze_heap, refresh_if_due, thaw_heap
from .process_sets import register_process_set
from .state import rank

log = logging.getLogger("ringtrain.ringcore")

__all__ = ["init", "shutdown", "start_timeline", "stop_timeline"]

_atexit_registered = False


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
    with _st.lock:
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
    if _st.current is not None:
        return
    _register_exit_handler()
    _apply_log_level()
    _join_late_if_added()
    rdv = _joining(read_environment())
    connection = lookup_backend(requested_backend(rdv))(rdv)
    try:
        backend = _with_shared_memory(connection)
    except BaseException:
        if connection.close is not None:
            connection.close()
        raise
    topo = connection.rendezvous.topology
    state = _st.RuntimeState(topo, connection.rendezvous, connection, backend)
    _st.current = state
    try:
        _start_engine(state, process_sets)
    except BaseException:  # the one way back from a half-made job
        _st.current = None
        _teardown(state)
        raise
    freeze_heap()  # the job is up: a full collection no longer walks the imports (heap)
    log.debug("rank %d/%d joined through %s", rdv.topology.rank, rdv.topology.size, rdv.source)


def _register_exit_handler() -> None:
    """Registered after torch's import, so it runs before torch's own exit handlers:
    a script that never calls shutdown() still leaves the ring in order, and the
    process group's threads are stopped before the interpreter tears down C++ state
    (otherwise: "terminate called without an active exception", SIGABRT)."""
    global _atexit_registered
    import torch.distributed  # noqa: F401  (see above: torch's handlers first)

    if not _atexit_registered:
        atexit.register(_shutdown_at_exit)
        _atexit_registered = True


def _join_late_if_added() -> None:
    """A worker added to a running elastic job waits for the generation that lists it."""
    if os.environ.get(cfg.ELASTIC_LATE_ENV_VAR) == "1":
        elastic_worker.join_late()
        os.environ[cfg.ELASTIC_LATE_ENV_VAR] = "0"


def _joining(rdv: Rendezvous) -> Rendezvous:
    """``rdv``, told how to see its ring superseded while an elastic ring re-forms
    (``rejoin()``: a rank that moved on to a newer generation never comes to this one)."""
    if elastic_worker.rejoining():
        return dataclasses.replace(rdv, superseded=elastic_worker.superseded)
    return rdv


def _with_shared_memory(connection: Connection) -> Backend:
    """The connection's backend with the host's shared-memory plane in front of it, where
    the plan uses one (``ringcore.shm.layer``). A connection that met through no store of
    the job (MPI's own world, an adopted ``torch.distributed`` group) keeps its backend
    alone: the plane's ranks meet through the ring's store."""
    if connection.store is None or not connection.prefix:
        return connection.backend
    from ..shm import layer  # torch: imported once a job starts

    return layer.join(
        connection.backend,
        connection.store,
        connection.prefix,
        connection.rendezvous.topology,
        cfg.get_float(cfg.GLOO_TIMEOUT_ENV_VAR, cfg.DEFAULT_GLOO_TIMEOUT_S),
    )


def _advertised_address(rdv: Rendezvous) -> str:
    """Where rank 0's coordinator is reached: an address on the route, never merely what
    the hostname resolves to (often 127.0.1.1 on a real cluster)."""
    host = os.environ.get(cfg.HOSTNAME_ENV_VAR)
    if rdv.source.startswith("mpi"):
        single_host = rdv.topology.local_size == rdv.topology.size
        if host:
            return host
        return "127.0.0.1" if single_host else iface.outward_address()
    if rdv.store_addr and (rdv.is_store_host or is_loopback(rdv.store_addr)):
        return rdv.store_addr
    if host and not _resolves_to_loopback(host):
        return host
    route = iface.route_address(rdv.store_addr, rdv.store_port) if rdv.store_addr else None
    return route or host or socket.gethostbyname(socket.gethostname())


def _resolves_to_loopback(host: str) -> bool:
    if is_loopback(host):
        return True
    try:
        return is_loopback(socket.gethostbyname(host))
    except OSError:
        return False


def _coordinator_config(size: int, start_timeout_s: float) -> CoordinatorConfig:
    return CoordinatorConfig(
        size=size,
        fusion_threshold=cfg.get_int(cfg.FUSION_THRESHOLD_ENV_VAR, cfg.DEFAULT_FUSION_THRESHOLD),
        cycle_time_s=_cycle_time_s(),
        cache_capacity=cfg.get_int(cfg.CACHE_CAPACITY_ENV_VAR, cfg.DEFAULT_CACHE_CAPACITY),
        stall_check_s=cfg.get_float(cfg.STALL_CHECK_TIME_ENV_VAR, cfg.DEFAULT_STALL_CHECK_TIME_S),
        stall_shutdown_s=cfg.get_float(
            cfg.STALL_SHUTDOWN_TIME_ENV_VAR, cfg.DEFAULT_STALL_SHUTDOWN_TIME_S
        ),
        stall_check_enabled=not cfg.get_bool(cfg.STALL_CHECK_DISABLE_ENV_VAR),
        autotune=cfg.get_bool(cfg.AUTOTUNE_ENV_VAR),
        autotune_log=cfg.get_env(cfg.AUTOTUNE_LOG_ENV_VAR),
        start_timeout_s=start_timeout_s,
        heartbeat_s=min(cfg.HEARTBEAT_INTERVAL_S, cfg.control_timeout_s() / 4),
    )


def _cycle_time_s() -> float:
    return cfg.get_float(cfg.CYCLE_TIME_ENV_VAR, cfg.DEFAULT_CYCLE_TIME_MS) / 1000.0


def _start_coordinator(state: _st.RuntimeState, secret: str | None, timeout: float) -> dict:
    """Rank 0: start the coordinator; returns the offer every rank gets (its address,
    and rank 0's fresh secret when the job has none)."""
    advertised = _advertised_address(state.rendezvous)
    made = None if secret else new_secret()
    state.coordinator = Coordinator(
        _coordinator_config(state.topology.size, timeout),
        secret=secret or made,  # type: ignore[arg-type]
        host="127.0.0.1" if is_loopback(advertised) else "0.0.0.0",
    )
    state.coordinator.start()
    # Without RING_SECRET_KEY rank 0's fresh secret goes to the ranks over the
    # backend (Gloo's connections, never the store); see "Trust model". Rank 0's fusion
    # threshold and fast-lane switch go with it: the fast lane buckets on every rank as
    # the coordinator does, whatever each rank's own environment says.
    return {
        "addr": f"{advertised}:{state.coordinator.port}",
        "secret": made,
        "fusion_threshold": state.coordinator.cfg.fusion_threshold,
        "fast_lane": cfg.fast_lane_wanted(),
    }


def _start_engine(state: _st.RuntimeState, process_sets: Any) -> None:
    """Start the coordinator (rank 0) and this rank's engine, then what they enable."""
    from ..engine.engine import Engine  # torch: once a job starts

    topo, backend = state.topology, state.backend
    timeout = cfg.get_float(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
    secret = job_secret()
    offer = _start_coordinator(state, secret, timeout) if topo.rank == 0 else {}
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
        _st.timeline,
        connect_timeout_s=timeout,
        cycle_time_s=_cycle_time_s(),
        secret=secret,
        control_timeout_s=cfg.control_timeout_s(),
        fusion_threshold=int(offer["fusion_threshold"]),
        fast_lane=bool(offer["fast_lane"]),
        on_idle=refresh_if_due,  # the frozen heap's refresh, from the sender thread
    )
    state.dynamic_process_sets = process_sets == "dynamic" or cfg.get_bool(
        cfg.DYNAMIC_PROCESS_SETS_ENV_VAR
    )
    _start_timeline_from_env(topo.rank)
    if isinstance(process_sets, list | tuple):
        for ps in process_sets:
            register_process_set(ps)


def _start_timeline_from_env(rank: int) -> None:
    path = cfg.get_env(cfg.TIMELINE_ENV_VAR)
    # "DYNAMIC" (Horovod's spelling): no file at start-up, start_timeline() later
    if path and path.upper() != "DYNAMIC" and rank == 0 and not _st.timeline.active:
        _st.timeline.start(path, mark_cycles=cfg.get_bool(cfg.TIMELINE_MARK_CYCLES_ENV_VAR))


def _teardown(state: _st.RuntimeState) -> None:
    if state.engine is not None:
        state.engine.close()
    if state.coordinator is not None:
        state.coordinator.thread.join(timeout=30.0)
    _st.timeline.stop()
    try:
        if state.backend is not state.connection.backend:  # the shared-memory plane
            state.backend.close()  # type: ignore[attr-defined]
    finally:
        if state.connection.close is not None:  # e.g. destroy the process group we formed
            state.connection.close()
    thaw_heap()


def shutdown() -> None:
    """Leave the job; ``init()`` may be called again afterwards."""
    with _st.lock:
        state = _st.current
        if state is None:
            return
        _st.current = None
        _teardown(state)


def _shutdown_at_exit() -> None:
    try:
        shutdown()
    except Exception as exc:  # the process is exiting: say why, never raise
        log.warning("shutdown at interpreter exit failed: %s: %s", type(exc).__name__, exc)


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Record a Chrome-trace timeline of every op to ``file_path`` (rank 0 writes it)."""
    if rank() == 0:
        _st.timeline.start(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    _st.timeline.stop()
