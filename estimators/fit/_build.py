"""Step 5 of a fit: the trained model, from the run's final checkpoint, as a ``RingModel``.

The model's framework loads the checkpoint (``Framework.load_checkpoint``); the
``RingModel`` carries the history, the columns, the features' shapes, the store and
the label kinds (Vector labels give Vector outputs in ``transform``); with an active
MLflow run the model is logged in the framework's flavour.
"""

from __future__ import annotations

from typing import Any

from .._model import RingModel
from ..tracking._mlflow import log_model_to_mlflow
from ._config import FitConfig, PreparedData

__all__ = ["build_model"]


def build_model(
    cfg: FitConfig, data: PreparedData, history: list[dict[str, Any]], use_gpu: bool | None
) -> RingModel:
    """The :class:`RingModel` of the run; ``use_gpu`` is the param as set (None: auto), so
    ``transform`` decides per task."""
    model = RingModel(
        model=cfg.framework.load_checkpoint(cfg),
        history=history,
        run_id=cfg.run_id,
        feature_cols=cfg.feature_cols,
        label_cols=cfg.label_cols,
        output_cols=[f"{label}__output" for label in cfg.label_cols],
        feature_shapes=data.feature_shapes,
        store=cfg.store,
        use_gpu=use_gpu,
    )
    model._set(**cfg.framework.model_params(cfg))  # e.g. the tokenizer transform runs
    if cfg.label_kinds is not None:  # Vector labels give Vector outputs (RingModel.transform)
        model.setLabelKinds(cfg.label_kinds)
    log_model_to_mlflow(cfg.framework, model.getModel())  # when an MLflow run is active
    return model
