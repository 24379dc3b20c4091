"""Starting a fit's workers, and explaining their failures when the store caused them.

:func:`spark_launcher` is the estimator's default ``launcher``: one Spark barrier stage
of ``num_proc`` tasks (``spark_runner.run``). :func:`check_slots` fails before the data
is written when the cluster cannot hold that stage. :func:`launch` records what the run
trains (``_runs.record_run``), calls the launcher, and rewrites a failure caused by
the store: a worker's ``OSError`` (a full disk, a read-only store), or a store that
refuses a write now, comes back as the same :class:`~ringcore.WorkerError` with a
message that names the store, the last complete checkpoint (checked readable) and the
fix.
"""

from __future__ import annotations

import contextlib
import io
import posixpath
import uuid
from collections.abc import Callable
from typing import Any

import torch

from ringcore import WorkerError

from ._runs import record_run

__all__ = ["check_slots", "launch", "spark_launcher"]


def spark_launcher(fn: Callable[..., Any], args: tuple, num_proc: int) -> list[Any]:
    """Run ``fn(*args)`` on ``num_proc`` tasks of one Spark barrier stage. The stage's
    own launch and end lines go to DEBUG (``verbose=0``): the fit says its own, the end
    line after every epoch's line (rank 0's epochs reach the driver through the store,
    after the stage's end)."""
    import spark_runner

    return spark_runner.run(fn, args=args, num_proc=num_proc, verbose=0)


def check_slots(spark: Any, num_proc: int) -> None:
    """Fail with NotEnoughSlotsError (a ValueError) before the data is written when the
    cluster cannot hold ``num_proc`` barrier tasks (a cluster master waits for executors
    up to ``RING_SPARK_START_TIMEOUT``, as ``spark_runner.run`` does). ``spark``: a
    classic or a Spark Connect session (there the slots of the server's cluster)."""
    from ringcore.launch import get_float
    from spark_runner import DEFAULT_START_TIMEOUT_S, START_TIMEOUT_ENV_VAR, wait_for_slots

    timeout = get_float(START_TIMEOUT_ENV_VAR, DEFAULT_START_TIMEOUT_S)
    wait_for_slots(spark, num_proc, timeout)


def _os_error_names() -> set[str]:
    names, todo = set(), [OSError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _checkpoint_state(cfg: Any) -> str:
    path = cfg.store.find_checkpoint(cfg.run_id)
    if path is None:
        return f"No checkpoint of run {cfg.run_id!r} was written yet."
    try:
        checkpoint = torch.load(
            io.BytesIO(cfg.store.read_bytes(path)), weights_only=True, map_location="cpu"
        )
        epoch = int(checkpoint["epoch"])
    except Exception as exc:
        return f"The checkpoint at {path} cannot be read ({type(exc).__name__}: {exc})."
    return (
        f"The last complete checkpoint, epoch {epoch} of {cfg.epochs}, is intact at {path}; "
        f"fit again with run_id={cfg.run_id!r} to resume from it."
    )


def _store_problem(cfg: Any) -> str | None:
    """Why the run's checkpoint folder refuses a one-byte write now, or None if it takes it."""
    folder = cfg.store.get_checkpoints_path(cfg.run_id)
    probe = posixpath.join(folder, f".ringtrain-write-probe-{uuid.uuid4().hex[:8]}")
    try:
        cfg.store.write_bytes(probe, b"x")
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        with contextlib.suppress(OSError):
            cfg.store.rm(probe)
    return None


def launch(launcher: Callable[..., list[Any]], fn: Any, args: tuple, cfg: Any) -> list[Any]:
    """``launcher(fn, args, num_proc)``; a failure caused by the store (a worker's OSError,
    or a store that refuses a write now) is explained (see the module docstring)."""
    if getattr(cfg, "run_params", None):  # what this run trains, before its first checkpoint
        record_run(cfg.store, cfg.run_id, cfg.run_params)
    try:
        return launcher(fn, args, cfg.num_proc)
    except WorkerError as err:
        problem = _store_problem(cfg)
        if problem is None and err.error_type not in _os_error_names():
            raise
        message = (
            f"{err.message} — the workers could not write to the store {cfg.store.prefix_path} "
            f"({problem or err.message}). Free space in it or restore write access. "
            f"{_checkpoint_state(cfg)}"
        )
        raise WorkerError(
            err.rank, err.host, err.error_type, message, err.traceback, err.output
        ) from err
