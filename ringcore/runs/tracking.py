"""What a run records in MLflow, from the driver: params, metrics by step, artifacts, the
model, and how the run ends.

:class:`MlflowLog` logs to one MLflow run by its id through an ``MlflowClient``, so it
works from any thread (MLflow's fluent API sees the active run only on the thread that
started it; the estimators' history poller and RingTrainer's report loop are other
threads): :meth:`~MlflowLog.log_params` (values cut to what a tracking server keeps),
:meth:`~MlflowLog.log_metrics` (one batch, step = the epoch or the report's number),
:meth:`~MlflowLog.log_artifacts`, :meth:`~MlflowLog.end`. :func:`log_model` logs a
trained model in a flavour the caller picks, warning instead of failing when that
flavour cannot log it. :func:`numeric` picks the numbers of a metrics dict, for MLflow,
TensorBoard and the progress display alike. Nothing here imports mlflow until it logs:
:func:`active_run` looks for a run only when the user's code imported mlflow already.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Iterable
from typing import Any

log = logging.getLogger("ringtrain.runs")

__all__ = ["MAX_PARAM_CHARS", "MlflowLog", "active_run", "flatten", "log_model", "numeric"]

#: what an MLflow tracking server keeps of a param value
MAX_PARAM_CHARS = 6000


def flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a/b": 1}``."""
    flat: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten(value, f"{name}/"))
        else:
            flat[name] = value
    return flat


def numeric(
    metrics: dict, *, skip: Iterable[str] = (), nested: bool = True, finite: bool = True
) -> dict[str, float]:
    """The numbers of ``metrics`` as floats, bools and text left out, and the names in
    ``skip``. ``nested``: dicts inside are flattened (``a/b``), else only the top level's
    string keys count; ``finite``: NaN and infinities are left out too."""
    items = flatten(metrics).items() if nested else metrics.items()
    skipped = set(skip)
    return {
        k: float(v)
        for k, v in items
        if isinstance(k, str)
        and k not in skipped
        and isinstance(v, (int, float))
        and not isinstance(v, bool)
        and (not finite or math.isfinite(v))
    }


def active_run() -> Any:
    """MLflow's active run of this thread, or None (also when mlflow is not imported)."""
    mlflow = sys.modules.get("mlflow")
    return None if mlflow is None else mlflow.active_run()


class MlflowLog:
    """One MLflow run, by id, logged through ``client`` (default: an ``MlflowClient()``
    of the current tracking URI, made on first use)."""

    def __init__(self, run_id: str, client: Any = None):
        self.run_id = run_id
        self._client = client

    @property
    def client(self) -> Any:
        if self._client is None:
            from mlflow.tracking import MlflowClient

            self._client = MlflowClient()
        return self._client

    def log_params(self, params: dict[str, Any]) -> None:
        """``params`` (nested dicts flattened with ``/``) as text, each cut to
        :data:`MAX_PARAM_CHARS`."""
        pairs = [(k, str(v)[:MAX_PARAM_CHARS]) for k, v in flatten(params).items()]
        if pairs:
            from mlflow.entities import Param

            self.client.log_batch(self.run_id, params=[Param(k, v) for k, v in pairs])

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """``metrics`` at ``step``, in one batch, stamped now."""
        if not metrics:
            return
        from mlflow.entities import Metric

        stamp = int(time.time() * 1000)
        batch = [Metric(k, v, stamp, step) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=batch)

    def log_artifacts(self, local_dir: str, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, local_dir, artifact_path=artifact_path)

    def end(self, status: str) -> None:
        """End the run with ``status`` (``FINISHED``, ``FAILED``)."""
        self.client.set_terminated(self.run_id, status=status)


def log_model(log_flavour: Callable[[], str | None], what: str) -> str | None:
    """Log a trained model to the active run with ``log_flavour()`` (a flavour's
    ``log_model``, returning the model's URI); None when no run is active, or when the
    flavour could not log it (a warning names ``what`` and why: the run succeeded, a
    model MLflow cannot log is no failure)."""
    if active_run() is None:
        return None
    try:
        with warnings.catch_warnings():  # MLflow's own notes on type hints, not ours to raise
            warnings.simplefilter("ignore")
            return log_flavour()
    except Exception as exc:
        log.warning(
            "could not log the trained %s model to MLflow (%s: %s); the run has its params "
            "and metrics, and the model is in the store's checkpoint",
            what,
            type(exc).__name__,
            exc,
        )
        return None
