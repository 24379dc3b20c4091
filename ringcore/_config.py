"""Every knob of ringcore in one place: environment variable names and typed defaults.

Each ``RING_X`` variable may also be spelled ``HOROVOD_X``; the ``RING_`` spelling wins.
"""

from __future__ import annotations

import os

# Topology, set by our runners (spark_runner, ray_runner, ringcore.testing).
RANK_ENV_VAR = "RING_RANK"
SIZE_ENV_VAR = "RING_SIZE"
LOCAL_RANK_ENV_VAR = "RING_LOCAL_RANK"
LOCAL_SIZE_ENV_VAR = "RING_LOCAL_SIZE"
CROSS_RANK_ENV_VAR = "RING_CROSS_RANK"
CROSS_SIZE_ENV_VAR = "RING_CROSS_SIZE"
HOSTNAME_ENV_VAR = "RING_HOSTNAME"
# Rendezvous: where the key-value store of this job listens.
STORE_ADDR_ENV_VAR = "RING_STORE_ADDR"
STORE_PORT_ENV_VAR = "RING_STORE_PORT"
# "1" when a coordinator outside the ranks hosts the store (else rank 0 hosts it).
STORE_EXTERNAL_ENV_VAR = "RING_STORE_EXTERNAL"

BACKEND_ENV_VAR = "RING_BACKEND"
DEFAULT_BACKEND = "gloo"

START_TIMEOUT_ENV_VAR = "RING_START_TIMEOUT"
DEFAULT_START_TIMEOUT_S = 120.0

GLOO_TIMEOUT_ENV_VAR = "RING_GLOO_TIMEOUT_SECONDS"
DEFAULT_GLOO_TIMEOUT_S = 300.0

LOG_LEVEL_ENV_VAR = "RING_LOG_LEVEL"


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


def get_int(name: str, default: int) -> int:
    raw = get_env(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; e.g. {default}") from None
