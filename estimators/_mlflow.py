"""Optional MLflow logging of a fit, on the driver.

When ``mlflow`` is imported in the driver and a run is active (``mlflow.start_run()``),
``fit`` logs the run's params (``ringtrain.*``) and every epoch's metrics (step = the
epoch number, from 1) to that run after training. Nothing is imported otherwise: a run
can only be active when the user's code has imported mlflow already.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["log_to_mlflow"]


def _params(cfg: Any) -> dict[str, Any]:
    return {
        "ringtrain.run_id": cfg.run_id,
        "ringtrain.framework": cfg.framework,
        "ringtrain.model": type(cfg.model).__name__,
        "ringtrain.num_proc": cfg.num_proc,
        "ringtrain.batch_size": cfg.batch_size,
        "ringtrain.epochs": cfg.epochs,
        "ringtrain.random_seed": cfg.seed,
        "ringtrain.store": cfg.store.prefix_path,
    }


def log_to_mlflow(cfg: Any, history: list[dict[str, Any]]) -> bool:
    """Log to the active MLflow run, if any; returns whether it logged."""
    mlflow = sys.modules.get("mlflow")
    if mlflow is None or mlflow.active_run() is None:
        return False
    mlflow.log_params(_params(cfg))
    for entry in history:
        metrics = {
            k: float(v)
            for k, v in entry.items()
            if k != "epoch" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        mlflow.log_metrics(metrics, step=int(entry["epoch"]))
    return True
