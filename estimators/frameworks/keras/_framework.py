"""Keras 3 models: the :class:`~estimators.frameworks.Framework` for ``"keras"``.

The optimizer and the loss come as params or from ``model.compile`` (``_config``); the
model travels to the workers as ``.keras`` bytes, not cloudpickle (``_model_io``); the
workers run Keras's own ``model.fit`` (``_train``); checkpoints and saved models are
``.keras`` files (``_checkpoint``). There is no first batch to try on the driver (Keras
checks shapes when it builds the model). TensorFlow and Keras are imported only inside
the functions that need them: a torch fit never pays for them.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

from .._base import Framework, Predictor
from ._checkpoint import checkpoint_epoch, load_keras_checkpoint
from ._config import KERAS_PARAMS, check_keras, keras_config
from ._model_io import load_keras_model, save_keras_model
from ._predict import keras_predictor
from ._spec import keras_spec
from ._train import train_keras

__all__ = ["KerasFramework", "is_keras_model"]

_WITH_KERAS = (
    "a Keras model configures this with Keras callbacks (LearningRateScheduler, "
    "EarlyStopping) or in model.compile"
)


def is_keras_model(model: Any) -> bool:
    """A Keras 3 ``keras.Model`` (``tf.keras.Model`` is the same class under TF >= 2.16);
    Keras is not imported."""
    keras = sys.modules.get("keras")
    cls = getattr(keras, "Model", None) if keras is not None else None
    return cls is not None and isinstance(model, cls)


class KerasFramework(Framework):
    """The Keras framework (see the module docstring)."""

    name = "keras"
    pickles_model = False  # sent as .keras bytes
    params: Mapping[str, Any] = KERAS_PARAMS

    def refusal(self, name: str, value: Any, model: Framework) -> str:
        instead = model.instead(name)
        return (
            f"{name}={value!r} is set, but it configures a Keras model's fit and the model "
            f"is a {model.name} model{': ' + instead if instead else ''}. Unset it "
            f"(setParams({name}={self.params[name]!r}))."
        )

    def instead(self, name: str) -> str | None:
        return _WITH_KERAS

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        """Optimizer and loss as params or from ``model.compile``; Keras resolves its own
        metric names."""
        check_keras(model, optimizer, loss)

    def resolve(self, params: Mapping[str, Any], cfg: Any) -> Any:
        return keras_config(params, cfg)

    def worker(self, cfg: Any, data: Any) -> tuple[Any, tuple]:
        return train_keras, (keras_spec(cfg, data),)

    def checkpoint_epoch(self, data: bytes) -> int:
        return checkpoint_epoch(data)

    def load_checkpoint(self, cfg: Any) -> Any:
        return load_keras_checkpoint(cfg)

    def predictor(
        self,
        model: Any,
        shapes: list[list[int]],
        staged: list[str],
        keep: int,
        names: list[str],
        use_gpu: bool | None,
    ) -> tuple[list[Any], Predictor]:
        """Loaded from ``.keras`` bytes once per task; Keras picks its own device."""
        return keras_predictor(model, shapes, staged, keep, names)

    def save_model(self, model: Any, path: str) -> None:
        """``<path>/model/model.keras``."""
        save_keras_model(model, path)

    def load_model(self, path: str) -> Any:
        return load_keras_model(path)

    def log_model(self, model: Any, name: str) -> str:
        import mlflow.keras

        return str(mlflow.keras.log_model(model, name=name).model_uri)
