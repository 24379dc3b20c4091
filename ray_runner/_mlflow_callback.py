"""``MLflowLoggerCallback``: a RingTrainer run as one MLflow run, logged live from the driver.

Ray Train's ``ray.air.integrations.mlflow.MLflowLoggerCallback`` under the same name
and arguments::

    RunConfig(callbacks=[MLflowLoggerCallback(tracking_uri="sqlite:///mlflow.db",
                                              experiment_name="digits", save_artifact=True)])

When the run starts (on the driver, before any worker) it opens an MLflow run named
after the RingTrainer run in ``experiment_name`` (made when missing; default: the
``MLFLOW_EXPERIMENT_NAME`` variable, else MLflow's default experiment) with ``tags``
and logs ``train_loop_config`` as params (nested dicts flattened with ``/``). Every
report of rank 0 is logged as it reaches the driver: its numbers as metrics, step = the
report's number (from 1, Ray's ``training_iteration``). At the end the run is
``FINISHED``, with the final checkpoint's files as the ``checkpoint`` artifact when
``save_artifact=True``; a run that fails ends ``FAILED``. The logging itself is the
run-services layer's (:class:`ringcore.runs.MlflowLog`, :func:`ringcore.runs.numeric`),
shared with the estimators' MLflow tracking.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ringcore.runs import MlflowLog, numeric

from ._callbacks import Callback

__all__ = ["MLflowLoggerCallback"]

#: the artifact folder of the final checkpoint's files
CHECKPOINT_ARTIFACT = "checkpoint"


class MLflowLoggerCallback(Callback):
    """Log a RingTrainer run to MLflow from the driver (see the module docstring)."""

    def __init__(
        self,
        tracking_uri: str | None = None,
        *,
        experiment_name: str | None = None,
        tags: dict[str, Any] | None = None,
        save_artifact: bool = False,
    ):
        for what, value in (("tracking_uri", tracking_uri), ("experiment_name", experiment_name)):
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(
                    f"MLflowLoggerCallback({what}={value!r}): pass a non-empty string or None"
                )
        if tags is not None and not isinstance(tags, dict):
            raise ValueError(
                f"MLflowLoggerCallback(tags={tags!r}): pass a dict of tag name -> value"
            )
        if not isinstance(save_artifact, bool):
            raise ValueError(
                f"MLflowLoggerCallback(save_artifact={save_artifact!r}): pass True or False"
            )
        try:
            import mlflow  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "MLflowLoggerCallback needs mlflow on the driver; pip install 'ringtrain[mlflow]'"
            ) from exc
        self.tracking_uri = tracking_uri
        self.experiment_name = experiment_name or os.environ.get("MLFLOW_EXPERIMENT_NAME")
        self.tags = {str(k): str(v) for k, v in (tags or {}).items()}
        self.save_artifact = save_artifact
        self.run_id: str | None = None  # the MLflow run of the latest RingTrainer run
        self._client: Any = None
        self._log: MlflowLog | None = None
        self._step = 0

    def _experiment_id(self) -> str:
        if self.experiment_name is None:
            from mlflow.tracking.default_experiment import DEFAULT_EXPERIMENT_ID

            return DEFAULT_EXPERIMENT_ID
        found = self._client.get_experiment_by_name(self.experiment_name)
        if found is not None:
            return found.experiment_id
        return self._client.create_experiment(self.experiment_name)

    def on_start(self, *, name: str, path: str, config: dict | None) -> None:
        from mlflow.tracking import MlflowClient

        self._client = MlflowClient(tracking_uri=self.tracking_uri)
        self._step = 0
        tags = {"ringtrain.run_path": path, **self.tags}
        run = self._client.create_run(self._experiment_id(), run_name=name, tags=tags)
        self.run_id = run.info.run_id
        self._log = MlflowLog(self.run_id, self._client)
        self._log.log_params(config or {})

    def on_report(self, metrics: dict, checkpoint: Any) -> None:
        self._step += 1
        assert self._log is not None  # on_start came first
        self._log.log_metrics(numeric(metrics), self._step)

    def on_end(self, result: Any) -> None:
        assert self._log is not None
        if self.save_artifact and result.checkpoint is not None:
            local = result.checkpoint.to_directory()
            try:
                self._log.log_artifacts(local, CHECKPOINT_ARTIFACT)
            finally:
                shutil.rmtree(local, ignore_errors=True)
        self._log.end("FINISHED")

    def on_error(self, error: BaseException) -> None:
        if self._log is not None:
            self._log.end("FAILED")
