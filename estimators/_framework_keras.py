"""Keras 3 models: the :class:`~estimators._frameworks.Framework` for ``"keras"``.

The optimizer and the loss come as params or from ``model.compile``; the model travels
to the workers as ``.keras`` bytes (not cloudpickle); the workers run Keras's own
``model.fit`` (``_train_keras.train_keras``); checkpoints and saved models are
``.keras`` files. There is no first batch to try on the driver (Keras checks shapes
when it builds the model). Everything here defers to ``_train_keras``, imported inside
each method, and TensorFlow / Keras only inside its functions: a torch fit never pays
for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._frameworks import KERAS, Predictor

__all__ = ["FRAMEWORK", "KerasFramework"]


@dataclass(frozen=True)
class KerasFramework:
    """The Keras framework (see the module docstring)."""

    name: str = KERAS
    pickles_model: bool = False  # sent as .keras bytes

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        """Optimizer and loss as params or from ``model.compile``; Keras resolves its own
        metric names."""
        from ._train_keras import check_keras

        check_keras(model, optimizer, loss)

    def check_first_batch(self, cfg: Any, batch: dict[str, Any]) -> None:
        """Nothing on the driver (see the module docstring)."""

    def check_prepared(self, cfg: Any, data: Any) -> None:
        """Nothing on the driver (see the module docstring)."""

    def worker(self, cfg: Any, data: Any) -> tuple[Any, tuple]:
        from ._train_keras import keras_worker

        return keras_worker(cfg, data)

    def load_checkpoint(self, cfg: Any) -> Any:
        from ._train_keras import load_keras_checkpoint

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
        from ._train_keras import keras_predictor

        return keras_predictor(model, shapes, staged, keep, names)

    def save_model(self, model: Any, path: str) -> None:
        """``<path>/model/model.keras``."""
        from ._train_keras import save_keras_model

        save_keras_model(model, path)

    def load_model(self, path: str) -> Any:
        from ._train_keras import load_keras_model

        return load_keras_model(path)


FRAMEWORK = KerasFramework()
