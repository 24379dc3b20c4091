"""torch ``nn.Module`` models: the :class:`~estimators.frameworks.Framework` for ``"torch"``.

Each step lives in its own module: the params and their checks (``_config``:
:data:`~._config.TORCH_PARAMS`, refused for other frameworks' models), a first batch
through the model and the loss on the driver (``_checks``), the worker's spec
(``_spec``) and loop (``_loop``), the checkpoint and saved model (``_checkpoint``),
``transform`` in Arrow batches (``_predict``), and MLflow's ``pytorch`` flavour. How
the model is called (``_calling.ModelCall``: ``model(*features)``) comes from
:meth:`TorchFramework.fit_call` / :meth:`~TorchFramework.predict_call`, the seam the
Hugging Face framework (``..huggingface``) overrides to call its models by name.
:class:`TorchFramework` is also the base of the Lightning one: a LightningModule is an
``nn.Module``, and loads, predicts and saves as one.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .._base import Framework, Predictor
from . import _checkpoint
from ._calling import ModelCall
from ._checks import check_first_batch, check_torch_params
from ._config import TORCH_PARAMS, torch_config
from ._loop import train
from ._metrics import resolve_metrics
from ._predict import torch_predictor
from ._spec import torch_spec

__all__ = ["TorchFramework", "is_torch_module"]

_CHECKPOINT_CALLBACK = (
    "a torch model keeps the best epoch by itself: monitor, monitor_mode and "
    "restore_best_weights=True (the default)"
)


def is_torch_module(model: Any) -> bool:
    """Whether ``model`` is a ``torch.nn.Module`` (torch is imported only if it is)."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


class TorchFramework(Framework):
    """The torch ``nn.Module`` framework (see the module docstring)."""

    name = "torch"
    params: Mapping[str, Any] = TORCH_PARAMS

    def refusal(self, name: str, value: Any, model: Framework) -> str:
        return (
            f"{name}={value!r} is set, but it configures ringtrain's torch loop and the "
            f"model is a {model.name} model: {model.instead(name) or ''}. Unset it "
            f"(setParams({name}={self.params[name]!r}))."
        )

    def instead(self, name: str) -> str | None:
        return _CHECKPOINT_CALLBACK if name == "checkpoint_callback" else None

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        check_torch_params(model, optimizer, loss)
        resolve_metrics(metrics)

    def resolve(self, params: Mapping[str, Any], cfg: Any) -> Any:
        return torch_config(params, cfg)

    def check_resume(self, model: Any, store: Any, run_id: str, path: str) -> None:
        _checkpoint.check_resume(model, store, run_id, path)

    # --- how the model is called: the seam a framework of other torch models overrides --

    def fit_call(self, cfg: Any) -> ModelCall:
        """How the fit's workers (and the first-batch check) call ``cfg.model``."""
        return ModelCall()

    def predict_call(self, model: Any, params: Mapping[str, Any]) -> ModelCall:
        """How ``transform`` calls ``model``, from the ``RingModel``'s ``params``."""
        return ModelCall()

    def check_first_batch(self, cfg: Any, batch: dict[str, Any]) -> None:
        call = self.fit_call(cfg)
        if cfg.loss is not None or call.own_loss:
            check_first_batch(cfg, batch, call)

    def worker(self, cfg: Any, data: Any) -> tuple[Any, tuple]:
        return train, (torch_spec(cfg, data, self.fit_call(cfg)),)

    def checkpoint_epoch(self, data: bytes) -> int:
        return _checkpoint.checkpoint_epoch(data)

    def load_checkpoint(self, cfg: Any) -> Any:
        return _checkpoint.load_checkpoint(cfg)

    def predictor(
        self,
        model: Any,
        shapes: list[list[int]],
        staged: list[str],
        keep: int,
        names: list[str],
        use_gpu: bool | None,
    ) -> tuple[list[Any], Predictor]:
        return torch_predictor(model, shapes, staged, keep, names, use_gpu)

    def model_predictor(
        self,
        model: Any,
        shapes: list[list[int]],
        staged: list[str],
        keep: int,
        names: list[str],
        use_gpu: bool | None,
        params: Mapping[str, Any],
    ) -> tuple[list[Any], Predictor]:
        call = self.predict_call(model, params)
        return torch_predictor(model, shapes, staged, keep, names, use_gpu, call)

    def save_model(self, model: Any, path: str) -> None:
        _checkpoint.save_module(model, path)

    def load_model(self, path: str) -> Any:
        return _checkpoint.load_module(path)

    def log_model(self, model: Any, name: str) -> str:
        import mlflow.pytorch
        import torch

        info = mlflow.pytorch.log_model(
            model,
            name=name,
            serialization_format="pickle",  # pt2 would need an input example
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
        )
        return str(info.model_uri)
