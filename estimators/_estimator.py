"""``RingEstimator``: data-parallel training of a torch model as a Spark ML ``Estimator``.

``fit(df)`` follows DESIGN.md's data path: check the params against ``df.schema``
(before any job), write the data as balanced Parquet under the Store, run
:func:`estimators._train_torch.train` on ``num_proc`` Spark tasks through the
``launcher`` (``spark_runner.run``), print the metrics of each epoch, and load the
final checkpoint into a :class:`RingModel`.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import cloudpickle
import torch
from pyspark.ml import Estimator
from pyspark.sql import DataFrame

from ._config import FitConfig, resolve_config
from ._model import RingModel
from ._params import ESTIMATOR_PARAMS, GeneratedAccessors, init_params, with_params
from ._prepare import PreparedData, prepare_data
from ._report import HistoryPrinter
from ._train_torch import TrainSpec, train

__all__ = ["RingEstimator"]


def spark_launcher(fn: Callable[..., Any], args: tuple, num_proc: int) -> list[Any]:
    """Run ``fn(*args)`` on ``num_proc`` tasks of one Spark barrier stage."""
    import spark_runner

    return spark_runner.run(fn, args=args, num_proc=num_proc)


def _optimizer_groups(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def _train_spec(cfg: FitConfig, data: PreparedData) -> TrainSpec:
    return TrainSpec(
        user_objects=cloudpickle.dumps((cfg.model, type(cfg.optimizer), cfg.loss, cfg.metrics)),
        optimizer_groups=_optimizer_groups(cfg.model, cfg.optimizer),
        optimizer_state=cfg.optimizer.state_dict(),
        feature_cols=cfg.feature_cols,
        label_cols=cfg.label_cols,
        train_path=data.train_path,
        val_path=data.val_path,
        batch_size=cfg.batch_size,
        val_batch_size=cfg.val_batch_size,
        epochs=cfg.epochs,
        steps_per_epoch=data.steps_per_epoch,
        val_steps=cfg.validation_steps_per_epoch,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        reader=cfg.reader,
        reader_workers=cfg.reader_workers,
        backward_passes_per_step=cfg.backward_passes_per_step,
        store=cfg.store,
        run_id=cfg.run_id,
    )


@with_params(ESTIMATOR_PARAMS)
class RingEstimator(GeneratedAccessors, Estimator):
    """Train a torch ``nn.Module`` on a Spark DataFrame with ``num_proc`` workers.

    Params (each with a generated ``getX`` / ``setX``) are listed in
    ``estimators._params.ESTIMATOR_PARAMS``; pass them as keyword arguments.
    """

    #: The seam that starts the workers: ``launcher(fn, args, num_proc) -> results by rank``.
    launcher: Callable[[Callable[..., Any], tuple, int], list[Any]] = staticmethod(spark_launcher)

    def __init__(self, **kwargs: Any):
        super().__init__()
        init_params(self, ESTIMATOR_PARAMS, kwargs)

    def _fit(self, dataset: DataFrame) -> RingModel:
        cfg = resolve_config(self, dataset)
        data = prepare_data(dataset, cfg)
        spec = _train_spec(cfg, data)
        with HistoryPrinter(cfg.store, cfg.run_id, cfg.epochs, enabled=cfg.verbose >= 1) as printer:
            history = self.launcher(train, (spec,), cfg.num_proc)[0]
            printer.finish(history)
        return self._load_model(cfg, data, history)

    def _load_model(
        self, cfg: FitConfig, data: PreparedData, history: list[dict[str, Any]]
    ) -> RingModel:
        with cfg.store.open_read(cfg.store.get_checkpoint_path(cfg.run_id)) as f:
            checkpoint = torch.load(f, weights_only=True)
        model = copy.deepcopy(cfg.model)
        model.load_state_dict(checkpoint["model"])
        model.eval()
        return RingModel(
            model=model,
            history=history,
            run_id=cfg.run_id,
            feature_cols=cfg.feature_cols,
            label_cols=cfg.label_cols,
            output_cols=[f"{label}__output" for label in cfg.label_cols],
            feature_shapes=data.feature_shapes,
            store=cfg.store,
        )
