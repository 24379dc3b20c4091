"""Every knob of ray_runner in one place: environment variable names and typed defaults."""

from __future__ import annotations

import os

# How long start() waits for the placement group before giving up (seconds).
PLACEMENT_GROUP_TIMEOUT_ENV_VAR = "RING_PLACEMENT_GROUP_TIMEOUT"
DEFAULT_PLACEMENT_GROUP_TIMEOUT_S = 100.0

# Where RingTrainer keeps runs when RunConfig(storage_path=None).
STORAGE_PATH_ENV_VAR = "RING_STORAGE_PATH"
DEFAULT_STORAGE_PATH = "~/ringtrain_results"

# How often the driver collects rank 0's reports while the loop runs (seconds).
REPORT_POLL_INTERVAL_ENV_VAR = "RING_REPORT_POLL_INTERVAL"
DEFAULT_REPORT_POLL_INTERVAL_S = 0.2

# How long a rank's report() waits to reach the job's store (seconds).
REPORT_TIMEOUT_ENV_VAR = "RING_REPORT_TIMEOUT"
DEFAULT_REPORT_TIMEOUT_S = 300.0

# How long the driver waits for the other ranks' errors after the first failure (seconds).
# how long the driver holds a checkpoint for ranks that have not called report() at all
# yet in this attempt; then it commits without their shards
CHECKPOINT_WAIT_ENV_VAR = "RING_CHECKPOINT_WAIT"
DEFAULT_CHECKPOINT_WAIT_S = 30.0

FAILURE_GRACE_ENV_VAR = "RING_FAILURE_GRACE"
DEFAULT_FAILURE_GRACE_S = 2.0

# Elastic runs: how long a silent worker may take to answer the driver's ping (seconds).
PING_TIMEOUT_ENV_VAR = "RING_PING_TIMEOUT"
DEFAULT_PING_TIMEOUT_S = 3.0

# The GPUs of a rank's node (set beside CUDA_VISIBLE_DEVICES, as spark_runner does).
GPU_ADDRESSES_ENV_VAR = "RING_GPU_ADDRESSES"

CHECKPOINT_DIR_PREFIX = "checkpoint_"
PLACEMENT_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def storage_path(explicit: str | os.PathLike | None) -> str:
    """The storage root: the explicit one, else ``$RING_STORAGE_PATH``, else ``~/ringtrain_results``."""
    raw = (
        os.fspath(explicit)
        if explicit is not None
        else os.environ.get(STORAGE_PATH_ENV_VAR) or DEFAULT_STORAGE_PATH
    )
    return os.path.abspath(os.path.expanduser(raw))
