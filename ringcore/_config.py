"""Every knob of ringcore in one place: environment variable names and typed defaults.

Each ``RING_X`` variable may also be spelled ``HOROVOD_X``; the ``RING_`` spelling wins.
"""

from __future__ import annotations

import datetime
import os

# Topology, set by our runners (spark_runner, ray_runner, ringcore.testing).
RANK_ENV_VAR = "RING_RANK"
SIZE_ENV_VAR = "RING_SIZE"
LOCAL_RANK_ENV_VAR = "RING_LOCAL_RANK"
LOCAL_SIZE_ENV_VAR = "RING_LOCAL_SIZE"
CROSS_RANK_ENV_VAR = "RING_CROSS_RANK"
CROSS_SIZE_ENV_VAR = "RING_CROSS_SIZE"
HOSTNAME_ENV_VAR = "RING_HOSTNAME"
# The data-plane interface(s) (comma-separated); unset: the one on the route to the store.
IFACE_ENV_VAR = "RING_IFACE"
HOROVOD_GLOO_IFACE_ENV_VAR = "HOROVOD_GLOO_IFACE"  # Horovod's name for the same knob
# Rendezvous: where the key-value store of this job listens.
STORE_ADDR_ENV_VAR = "RING_STORE_ADDR"
STORE_PORT_ENV_VAR = "RING_STORE_PORT"
# "1" when a coordinator outside the ranks hosts the store (else rank 0 hosts it).
STORE_EXTERNAL_ENV_VAR = "RING_STORE_EXTERNAL"
# Key prefix of this ring's keys in the store (elastic jobs: one per generation).
STORE_PREFIX_ENV_VAR = "RING_STORE_PREFIX"

# Elastic jobs: a launcher that outlives the ranks hosts the store and publishes each
# generation's members there; every worker has an id that survives re-ranking.
ELASTIC_ENV_VAR = "RING_ELASTIC"
WORKER_ID_ENV_VAR = "RING_WORKER_ID"
ELASTIC_TIMEOUT_ENV_VAR = "RING_ELASTIC_TIMEOUT"
DEFAULT_ELASTIC_TIMEOUT_S = 600.0
RESET_LIMIT_ENV_VAR = "RING_RESET_LIMIT"
# "1": this worker was added to a running elastic job and joins through the next
# generation the driver publishes; init() sets "0" once it has joined.
ELASTIC_LATE_ENV_VAR = "RING_ELASTIC_LATE"

BACKEND_ENV_VAR = "RING_BACKEND"
DEFAULT_BACKEND = "gloo"

# "0": the torch.distributed backend "ring" (ringcore.dist_backend) moves every tensor
# through the Gloo group it holds, as backend="gloo" would; unset or "1": one host's CPU
# tensors go through the shared-memory data plane.
TORCH_BACKEND_ENV_VAR = "RING_TORCH_BACKEND"

START_TIMEOUT_ENV_VAR = "RING_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 120.0

# How long one Gloo operation may wait for a peer. A dead peer is noticed at once (its
# sockets close, its control connection too); this bounds a peer that hangs without
# closing anything (stopped process, unplugged host). Horovod's default is 30 s.
GLOO_TIMEOUT_ENV_VAR = "RING_GLOO_TIMEOUT_SECONDS"
DEFAULT_GLOO_TIMEOUT_S = 60.0

# How long a control connection (rank <-> coordinator) may go unanswered before it is
# declared lost: TCP keepalive probes while it is idle and TCP_USER_TIMEOUT while data
# waits for an acknowledgement. This bounds how long a partitioned or powered-off host
# (which sends no RST) goes unnoticed; a process that dies is noticed at once.
# It also bounds how long a rank waits on a rank 0 that hangs (a stopped process keeps
# its connections open): rank 0's coordinator sends a heartbeat whenever it has sent
# nothing for HEARTBEAT_INTERVAL_S (or a quarter of this timeout, if that is shorter).
CONTROL_TIMEOUT_ENV_VAR = "RING_CONTROL_TIMEOUT_SECONDS"
DEFAULT_CONTROL_TIMEOUT_S = 30.0
HEARTBEAT_INTERVAL_S = 1.0

# A test seam, read in one place (ringcore.engine.wire.ringtrain_version): set, this process
# claims that ringtrain version in the control handshake (tests of mixed versions).
TEST_FAKE_VERSION_ENV_VAR = "RING_TEST_FAKE_VERSION"
# how ringcore.testing.run_workers starts its ranks: "forkserver" (default) or "spawn"
RANK_START_ENV_VAR = "RING_RANK_START"

# The per-job secret that authenticates the engine's control connections (HMAC-SHA256).
# Our launchers set it; without it, rank 0 makes one and sends it to the ranks over the
# backend (see docs/status.md, "Trust model").
SECRET_KEY_ENV_VAR = "RING_SECRET_KEY"

# Level of the "ringtrain" loggers (Horovod's HOROVOD_LOG_LEVEL names): set at init().
LOG_LEVEL_ENV_VAR = "RING_LOG_LEVEL"
LOG_LEVELS = {
    "trace": 5,
    "debug": 10,
    "info": 20,
    "warning": 30,
    "error": 40,
    "fatal": 50,
}


def get_env(name: str, default: str | None = None) -> str | None:
    """Read ``RING_X``, falling back to its Horovod spelling ``HOROVOD_X``."""
    value = os.environ.get(name)
    if value is None and name.startswith("RING_"):
        value = os.environ.get("HOROVOD_" + name[len("RING_") :])
    return default if value is None else value


def get_float(name: str, default: float) -> float:
    raw = get_env(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(
            f"{name}={raw!r} is not a number; set it to seconds, e.g. {default:g}"
        ) from None


def group_timeout() -> datetime.timedelta:
    """The timeout of every torch group ringcore makes: the job's own and each one beside
    it (the hierarchical plane's cross-host groups, process sets, a Gloo side group), the
    job's Gloo timeout ``RING_GLOO_TIMEOUT_SECONDS``, computed here alone. torch gives
    ``new_group`` its own default (30 min), not the default group's: a rank whose peer in
    such a group was partitioned away waited that long instead of failing."""
    return datetime.timedelta(seconds=get_float(GLOO_TIMEOUT_ENV_VAR, DEFAULT_GLOO_TIMEOUT_S))


def get_int(name: str, default: int) -> int:
    raw = get_env(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; e.g. {default}") from None


# The op engine (Horovod's knobs, same names with RING_ or HOROVOD_).
FUSION_THRESHOLD_ENV_VAR = "RING_FUSION_THRESHOLD"
DEFAULT_FUSION_THRESHOLD = 128 * 1024 * 1024
CYCLE_TIME_ENV_VAR = "RING_CYCLE_TIME"
DEFAULT_CYCLE_TIME_MS = 1.0
CACHE_CAPACITY_ENV_VAR = "RING_CACHE_CAPACITY"
DEFAULT_CACHE_CAPACITY = 1024
TIMELINE_ENV_VAR = "RING_TIMELINE"
TIMELINE_MARK_CYCLES_ENV_VAR = "RING_TIMELINE_MARK_CYCLES"
STALL_CHECK_TIME_ENV_VAR = "RING_STALL_CHECK_TIME_SECONDS"
DEFAULT_STALL_CHECK_TIME_S = 60.0
STALL_SHUTDOWN_TIME_ENV_VAR = "RING_STALL_SHUTDOWN_TIME_SECONDS"
DEFAULT_STALL_SHUTDOWN_TIME_S = 0.0
# What the launchers (spark_runner, ray_runner, the estimators) set instead, unless the
# environment that builds the ranks' variables (or env=) says otherwise: a rank that
# never submits an op the others wait on fails the job after 10 minutes, not never.
DEFAULT_LAUNCHED_STALL_SHUTDOWN_TIME_S = 600.0
STALL_CHECK_DISABLE_ENV_VAR = "RING_STALL_CHECK_DISABLE"
DYNAMIC_PROCESS_SETS_ENV_VAR = "RING_DYNAMIC_PROCESS_SETS"
AUTOTUNE_ENV_VAR = "RING_AUTOTUNE"
# "0": every op goes through the coordinator, also on a one-host shared-memory group
FAST_LANE_ENV_VAR = "RING_FAST_LANE"
AUTOTUNE_LOG_ENV_VAR = "RING_AUTOTUNE_LOG"
# "0": init() leaves the collector's view of the heap alone (see ringcore.runtime.heap: on, it freezes
# the heap that init() finds and shutdown() thaws it)
GC_FREEZE_ENV_VAR = "RING_GC_FREEZE"
# seconds between refreshes of the frozen heap (thaw, full collection, freeze), so that
# what was alive at init() and became cyclic garbage since is freed; 0: never (see ringcore.runtime.heap)
GC_REFRESH_ENV_VAR = "RING_GC_REFRESH_SECONDS"
DEFAULT_GC_REFRESH_S = 30.0


def get_bool(name: str, default: bool = False) -> bool:
    raw = get_env(name)
    if raw is None or raw == "":
        return default
    return raw.strip().lower() in ("1", "true", "yes", "on")


def control_timeout_s() -> float:
    """``RING_CONTROL_TIMEOUT_SECONDS`` (>= 0): the bound on a silent control peer, for
    the sockets' keepalive and the ranks' wait on the coordinator's heartbeat; 0 leaves
    both to the OS defaults (no heartbeat)."""
    return max(0.0, get_float(CONTROL_TIMEOUT_ENV_VAR, DEFAULT_CONTROL_TIMEOUT_S))


def fast_lane_wanted() -> bool:
    """This process's knobs allow the fast lane: ``RING_FAST_LANE`` is not 0 and
    ``RING_AUTOTUNE`` is off (autotune tunes the coordinator's fusion and cycle: it must
    see the ops). Rank 0's answer is every rank's (``init()`` sends it at start-up)."""
    return get_bool(FAST_LANE_ENV_VAR, True) and not get_bool(AUTOTUNE_ENV_VAR)
