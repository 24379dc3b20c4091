"""What the store and the cluster must offer a fit, checked before any job.

The store takes writes (:func:`check_store_writable`: a probe file written and removed);
on Spark Connect the server sees the store this client writes to
(:func:`check_connect_store`); the cluster can hold ``num_proc`` barrier tasks
(:func:`check_slots`, for the Spark launcher).
"""

from __future__ import annotations

import contextlib
import posixpath
import uuid
from typing import Any

from ringcore.launch import get_float
from spark_runner import DEFAULT_START_TIMEOUT_S, START_TIMEOUT_ENV_VAR, wait_for_slots

__all__ = ["check_connect_store", "check_slots", "check_store_writable"]


def check_store_writable(store: Any) -> None:
    probe = posixpath.join(store.prefix_path, f".ringtrain-write-probe-{uuid.uuid4().hex[:8]}")
    try:
        store.write_bytes(probe, b"")
    except OSError as exc:
        raise ValueError(
            f"the store {store.prefix_path} does not take writes ({type(exc).__name__}: "
            f"{exc.strerror or exc}); fit writes its data and checkpoints there. Pass a store "
            "you can write to with setStore(...), or fix its permissions or free space."
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            store.rm(probe)


def check_connect_store(spark: Any, store: Any) -> None:
    """On a Spark Connect session the server's cluster writes the data into the store and
    this client reads it back (row counts, checkpoints, history), so both must reach the
    same store: a store on this client's disk (the default one, a temporary directory,
    say) is lost on a remote server. This client writes a probe file there and the server
    lists it (``inputFiles``: an analysis, no job); a server that cannot is refused."""
    name = f"ringtrain-connect-probe-{uuid.uuid4().hex[:8]}"  # no dot: Spark skips hidden files
    probe = posixpath.join(store.prefix_path, name)
    store.write_bytes(probe, b"")
    try:
        spark.read.text(store.url(probe)).inputFiles()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"the Spark Connect server cannot see the store {store.prefix_path}: this client "
            f"wrote {probe} there, and the server, reading {store.url(probe)}, got: {first}. "
            "On Spark Connect the server's cluster writes the training data into the store and "
            "this client reads it back, so both must reach it. Pass a store they share with "
            "setStore(...): a filesystem mounted at the same path on this client and the "
            "cluster, or an object store URL (s3://, gs://, abfs://, hdfs://, dbfs:/)."
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            store.rm(probe)


def check_slots(spark: Any, num_proc: int) -> None:
    """Fail with NotEnoughSlotsError (a ValueError) before the data is written when the
    cluster cannot hold ``num_proc`` barrier tasks (a cluster master waits for executors
    up to ``RING_SPARK_START_TIMEOUT``, as ``spark_runner.run`` does). ``spark``: a
    classic or a Spark Connect session (there the slots of the server's cluster)."""
    timeout = get_float(START_TIMEOUT_ENV_VAR, DEFAULT_START_TIMEOUT_S)
    wait_for_slots(spark, num_proc, timeout)
