"""Step 4 of a fit: the workers train, while the driver shows each epoch as it lands.

:func:`launch` has the model's framework check the prepared data a last time and give
its worker function (``Framework.check_prepared``, ``Framework.worker``), records what
the run trains (``store/_runs.record_run``), then calls the estimator's ``launcher``
(:func:`spark_launcher` by default: one Spark barrier stage of ``num_proc`` tasks,
``spark_runner.run``) while a :class:`~estimators.tracking._report.HistoryPrinter`
prints each epoch rank 0 wrote and MLflow logs it. A failure caused by the store (a
worker's ``OSError``: a full disk, a read-only store; or a store that refuses a write
now) comes back as the same :class:`~ringcore.WorkerError` with a message that names
the store, the last complete checkpoint (checked readable) and the fix.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import posixpath
import time
import uuid
from collections.abc import Callable
from typing import Any

from ringcore import WorkerError
from ringcore.progress import progress_enabled, say

from ..store._runs import record_run
from ..tracking._mlflow import MlflowTracker
from ..tracking._report import HistoryPrinter
from ._config import FitConfig, PreparedData

_log = logging.getLogger("ringtrain.estimators")

__all__ = ["launch", "spark_launcher"]

Launcher = Callable[[Callable[..., Any], tuple, int], list[Any]]


def spark_launcher(
    fn: Callable[..., Any], args: tuple, num_proc: int, use_gpu: bool | None = None
) -> list[Any]:
    """Run ``fn(*args)`` on ``num_proc`` tasks of one Spark barrier stage. The stage's
    own launch and end lines go to DEBUG (``verbose=0``): the fit says its own, the end
    line after every epoch's line (rank 0's epochs reach the driver through the store,
    after the stage's end). ``use_gpu=True``: one GPU per task, asked of Spark as
    ``spark_runner.run(use_gpu=True)`` does (the stage's own ResourceProfile where the
    cluster has stage-level scheduling)."""
    import spark_runner

    return spark_runner.run(fn, args=args, num_proc=num_proc, verbose=0, use_gpu=use_gpu)


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
        epoch = cfg.framework.checkpoint_epoch(cfg.store.read_bytes(path))
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


def _with_env(fn: Callable[..., Any], env: dict[str, str], *args: Any) -> Any:
    """Run ``fn(*args)`` with ``env`` in ``os.environ``, restored afterwards (Spark reuses
    its Python workers)."""
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    try:
        return fn(*args)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def launch(launcher: Launcher, cfg: FitConfig, data: PreparedData) -> list[dict[str, Any]]:
    """The framework's last check, then its worker function on ``num_proc`` tasks through
    ``launcher``; the history of rank 0 (logged to MLflow when a run is active)."""
    cfg.framework.check_prepared(cfg, data)
    fn, args = cfg.framework.worker(cfg, data)
    if cfg.backend_env:  # Horovod's backend_env: set in every worker for the fit
        fn, args = _with_env, (fn, dict(cfg.backend_env), *args)
    tracker = MlflowTracker(cfg)  # params now, each epoch as it lands, FAILED on error
    show = cfg.verbose >= 1 and progress_enabled(cfg.progress)
    started = time.monotonic()
    say(_log, cfg.verbose, 1, "fitting run %s on %d workers", cfg.run_id, cfg.num_proc)
    with HistoryPrinter(
        cfg.store, cfg.run_id, cfg.epochs, cfg.verbose >= 1, None, show, tracker.log_epoch
    ) as printer:
        try:
            history = _run(launcher, fn, args, cfg)[0]  # explains store failures
        except BaseException:
            tracker.fail()
            raise
        printer.finish(history)  # every epoch's line and the last progress, then ours
    elapsed = time.monotonic() - started
    say(_log, cfg.verbose, 1, "fit finished on %d workers in %.1f s", cfg.num_proc, elapsed)
    tracker.finish(history)
    return history


def _run(launcher: Launcher, fn: Any, args: tuple, cfg: FitConfig) -> list[Any]:
    """``launcher(fn, args, num_proc)``; a failure caused by the store (a worker's OSError,
    or a store that refuses a write now) is explained (see the module docstring)."""
    if cfg.run_params:  # what this run trains, before its first checkpoint
        record_run(cfg.store, cfg.run_id, cfg.run_params)
    if launcher is spark_launcher and cfg.use_gpu:  # the fit trains on GPUs: ask Spark for them
        launcher = functools.partial(spark_launcher, use_gpu=True)
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
