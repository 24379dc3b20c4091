"""How the torch loop calls its model: a batch in, the model's result, outputs and a loss.

A :class:`ModelCall` is the one seam between the torch loop (``_step``, ``_checks``,
``_predict``) and the model's calling convention. The torch framework's own: one
float32 tensor per feature column, positionally (``model(*features)``), one output per
label column, the loss from the ``loss`` param. A framework whose models are called
otherwise (``estimators.frameworks.huggingface``: inputs by name, ``labels=``, the
model's own loss) gives its own from ``TorchFramework.model_call``; the call travels to
the workers in the spec and to the transform tasks with the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._tensors import as_outputs, to_device, to_inputs

__all__ = ["Inputs", "ModelCall", "inputs_to"]

#: a batch's model inputs: positional tensors and keyword tensors
Inputs = tuple[list[torch.Tensor], dict[str, torch.Tensor]]


def inputs_to(inputs: Inputs, device: torch.device) -> Inputs:
    """``inputs`` on ``device``."""
    args, kwargs = inputs
    return [to_device(t, device) for t in args], {
        k: to_device(v, device) for k, v in kwargs.items()
    }


@dataclass(frozen=True)
class ModelCall:
    """``model(*features)``, one output per label column, the ``loss`` param's loss."""

    #: the model computes the loss itself (``loss`` unset): :meth:`loss` gives it
    own_loss: bool = False

    def inputs(self, batch: dict[str, np.ndarray], columns: list[str]) -> Inputs:
        """The model's inputs from ``batch``'s ``columns`` (the feature columns, in order)."""
        return to_inputs(batch, columns), {}

    def probe(self, shapes: list[list[int]], columns: list[str]) -> Inputs:
        """Inputs of one all-zero row (one shape per column), to type the outputs."""
        return [torch.zeros(1, *shape) for shape in shapes], {}

    def __call__(self, model: Any, inputs: Inputs, labels: list[torch.Tensor] | None = None) -> Any:
        """The model's result on ``inputs`` (``labels``: given when :attr:`own_loss`)."""
        args, kwargs = inputs
        return model(*args, **kwargs)

    def outputs(self, result: Any, count: int) -> list[torch.Tensor]:
        """One tensor per label column out of the model's result."""
        return as_outputs(result, count)

    def loss(self, result: Any) -> torch.Tensor:
        """The model's own loss (only where :attr:`own_loss`)."""
        raise NotImplementedError("this model call takes its loss from the loss param")
