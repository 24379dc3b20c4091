"""Which framework a model belongs to, and the one interface every framework implements.

:func:`framework_of` names the framework of a ``model`` param — ``"torch"`` (an
``nn.Module``), ``"lightning"`` (a ``LightningModule``, trained through its own
``training_step`` / ``configure_optimizers``) or ``"keras"`` (a ``keras.Model``) —
without importing Lightning or Keras: a model of either exists only when its package is
already imported, so the checks look in ``sys.modules``.

:func:`get_framework` maps that name to the module that handles such models
(``_framework_torch``, ``_framework_lightning``, ``_framework_keras``): an object with
the methods of :class:`Framework`. The estimator, the model and persistence call those
methods; none of them compares framework names. The modules are imported on first use,
and each imports its framework's heavy packages (TensorFlow, Lightning) only inside the
methods that need them, so a torch fit never pays for Keras.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any, Protocol, runtime_checkable

__all__ = [
    "FRAMEWORKS",
    "KERAS",
    "LIGHTNING",
    "TORCH",
    "Framework",
    "Predictor",
    "framework_of",
    "get_framework",
    "is_keras_model",
    "is_lightning_module",
    "is_torch_module",
]

TORCH = "torch"
LIGHTNING = "lightning"
KERAS = "keras"
FRAMEWORKS = (TORCH, LIGHTNING, KERAS)

#: ``mapInArrow``'s function: Arrow batches in, the same batches with the outputs appended out.
Predictor = Callable[[Iterable[Any]], Iterable[Any]]


@runtime_checkable
class Framework(Protocol):
    """What ``fit``, ``transform`` and ``save`` / ``load`` need from a framework.

    ``cfg`` is the fit's ``FitConfig``; ``data`` its ``PreparedData``."""

    @property
    def name(self) -> str:
        """The registry key: one of :data:`FRAMEWORKS`."""
        ...

    @property
    def pickles_model(self) -> bool:
        """Whether the ``model`` param travels to the workers by cloudpickle (so it must pickle)."""
        ...

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        """Raise ValueError naming the param and its setter when these do not fit the model."""
        ...

    def check_first_batch(self, cfg: Any, batch: dict[str, Any]) -> None:
        """Run a few rows (``{column: ndarray}``) through the model and the loss on the
        driver, before any data is written; raise ValueError naming both shapes."""
        ...

    def check_prepared(self, cfg: Any, data: Any) -> None:
        """The last check before the workers start, on the prepared data's shapes."""
        ...

    def worker(self, cfg: Any, data: Any) -> tuple[Callable[..., Any], tuple]:
        """``(fn, args)``: the function every worker runs and its picklable arguments."""
        ...

    def load_checkpoint(self, cfg: Any) -> Any:
        """The trained model from the run's final checkpoint in the store."""
        ...

    def predictor(
        self,
        model: Any,
        shapes: list[list[int]],
        staged: list[str],
        keep: int,
        names: list[str],
        use_gpu: bool | None,
    ) -> tuple[list[Any], Predictor]:
        """The Spark type of each output column and the per-task ``mapInArrow`` function
        (the first ``keep`` columns pass through; ``staged`` are the model's inputs)."""
        ...

    def save_model(self, model: Any, path: str) -> None:
        """Write the model under ``<path>/model/`` (RingModel.save)."""
        ...

    def load_model(self, path: str) -> Any:
        """Read what :meth:`save_model` wrote (RingModel.load)."""
        ...


# The registry: framework name -> the module whose FRAMEWORK object handles it.
_MODULES = {
    TORCH: "._framework_torch",
    LIGHTNING: "._framework_lightning",
    KERAS: "._framework_keras",
}


def get_framework(name: str) -> Framework:
    """The :class:`Framework` registered under ``name`` (one of :data:`FRAMEWORKS`)."""
    if name not in _MODULES:
        raise ValueError(f"unknown framework {name!r}; ringtrain knows {', '.join(FRAMEWORKS)}.")
    return importlib.import_module(_MODULES[name], __package__).FRAMEWORK


# Lightning ships under two names: the unified ``lightning`` package and the older
# standalone ``pytorch_lightning``; their LightningModule classes are distinct.
_LIGHTNING_MODULES = ("lightning.pytorch", "pytorch_lightning")


def is_lightning_module(model: Any) -> bool:
    for name in _LIGHTNING_MODULES:
        module = sys.modules.get(name)
        cls = getattr(module, "LightningModule", None) if module is not None else None
        if cls is not None and isinstance(model, cls):
            return True
    return False


def is_keras_model(model: Any) -> bool:
    """A Keras 3 ``keras.Model`` (``tf.keras.Model`` is the same class under TF >= 2.16)."""
    keras = sys.modules.get("keras")
    cls = getattr(keras, "Model", None) if keras is not None else None
    return cls is not None and isinstance(model, cls)


def is_torch_module(model: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def framework_of(model: Any) -> str:
    """``"lightning"``, ``"keras"`` or ``"torch"`` for ``model``; ValueError for anything else.

    Lightning is tested before torch: a ``LightningModule`` is an ``nn.Module`` too.
    """
    if is_lightning_module(model):
        return LIGHTNING
    if is_keras_model(model):
        return KERAS
    if is_torch_module(model):
        return TORCH
    raise ValueError(
        f"model must be a torch.nn.Module, a LightningModule or a keras.Model, got "
        f"{type(model).__name__}. Set it with setModel(...)."
    )
