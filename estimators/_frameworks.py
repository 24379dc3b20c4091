"""Which framework a model belongs to: the one seam every model-type dispatch goes through.

:func:`framework_of` names the framework of a ``model`` param — ``"torch"`` (an
``nn.Module``), ``"lightning"`` (a ``LightningModule``, trained through its own
``training_step`` / ``configure_optimizers``) or ``"keras"`` (a ``keras.Model``) —
without importing Lightning or Keras: a model of either exists only when its package is
already imported, so the checks look in ``sys.modules``. The estimator, the model, the
config check and persistence each branch on this one answer (``if kind == KERAS: ...``),
never on their own ``isinstance`` tests.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = [
    "FRAMEWORKS",
    "KERAS",
    "LIGHTNING",
    "TORCH",
    "framework_of",
    "is_keras_model",
    "is_lightning_module",
    "is_torch_module",
]

TORCH = "torch"
LIGHTNING = "lightning"
KERAS = "keras"
FRAMEWORKS = (TORCH, LIGHTNING, KERAS)

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
