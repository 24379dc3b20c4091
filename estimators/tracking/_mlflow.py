"""Optional MLflow tracking of a fit, on the driver, live.

When ``mlflow`` is imported in the driver and a run is active (``mlflow.start_run()``),
``fit`` logs to that run: the params (``ringtrain.*``) before the workers start; each
epoch's metrics (step = the epoch number, from 1) as soon as rank 0 has written that
epoch to the store (the driver's history poller hands it over); the trained model at
the end, in the flavour its framework logs it with (``Framework.log_model``:
``mlflow.pytorch`` for torch and Lightning, ``mlflow.keras`` for Keras; a model that
the flavour cannot log is warned about, the fit is not failed);
and a failed fit ends the run with status ``FAILED``. Nothing is imported otherwise: a
run can only be active when the user's code has imported mlflow already.

The poller runs on another thread, where MLflow's fluent API sees no active run, so
metrics go through the run-services layer's :class:`ringcore.runs.MlflowLog` (an
``MlflowClient`` with the run's id), as RingTrainer's ``MLflowLoggerCallback`` logs.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

from ringcore.runs import MlflowLog, active_run, log_model, numeric

__all__ = ["MlflowTracker", "log_model_to_mlflow"]

MODEL_ARTIFACT = "model"


def _params(cfg: Any) -> dict[str, Any]:
    return {
        "ringtrain.run_id": cfg.run_id,
        "ringtrain.framework": cfg.framework.name,
        "ringtrain.model": type(cfg.model).__name__,
        "ringtrain.num_proc": cfg.num_proc,
        "ringtrain.batch_size": cfg.batch_size,
        "ringtrain.epochs": cfg.epochs,
        "ringtrain.random_seed": cfg.seed,
        "ringtrain.store": cfg.store.prefix_path,
    }


class MlflowTracker:
    """One fit's logging to the active MLflow run; a no-op object when there is none."""

    def __init__(self, cfg: Any):
        run = active_run()
        self.run_id: str | None = run.info.run_id if run is not None else None
        self._log = MlflowLog(self.run_id) if self.run_id is not None else None
        self._logged: set[int] = set()
        self._lock = threading.Lock()
        if self.run_id is not None:
            sys.modules["mlflow"].log_params(_params(cfg))

    def log_epoch(self, entry: dict[str, Any]) -> None:
        """Log one history entry (once per epoch number, from any thread)."""
        if self._log is None:
            return
        epoch = int(entry["epoch"])
        with self._lock:
            if epoch in self._logged:
                return
            self._logged.add(epoch)
        metrics = numeric(entry, skip=("epoch",), nested=False, finite=False)
        self._log.log_metrics(metrics, epoch)

    def finish(self, history: list[dict[str, Any]]) -> None:
        for entry in history:
            self.log_epoch(entry)

    def fail(self) -> None:
        """End the run with status FAILED (the fit raised)."""
        if self._log is None:
            return
        mlflow = sys.modules["mlflow"]
        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run(status="FAILED")
        else:
            self._log.end("FAILED")


def log_model_to_mlflow(framework: Any, model: Any) -> str | None:
    """Log the trained model to the active run, in ``framework``'s flavour
    (``Framework.log_model``); its URI, or None when no run is active or the flavour
    could not log it (then a warning says why)."""
    return log_model(lambda: framework.log_model(model, MODEL_ARTIFACT), framework.name)
