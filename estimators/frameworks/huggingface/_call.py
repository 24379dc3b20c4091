"""How a Hugging Face model is called: feature columns by name, ``labels=``, its own loss.

:class:`HfCall` is the torch loop's :class:`~..torch._calling.ModelCall` for a
``transformers.PreTrainedModel``: each feature column is passed to ``forward`` under its
name (``feature_cols=["input_ids", "attention_mask"]`` → ``model(input_ids=...,
attention_mask=...)``), integers as int64 and other numbers as float32; a text column
(strings) is tokenized here, on the worker or the transform task, into the inputs the
tokenizer makes (padded and truncated to ``max_length``) that ``forward`` takes. With
``own_loss`` the label column goes in as ``labels=`` and the loss is the model's
(``outputs.loss``); the output per label column is ``outputs.logits`` (or ``output``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..torch._calling import Inputs, ModelCall
from ..torch._tensors import as_outputs, tensor

__all__ = ["HfCall", "is_text"]


def is_text(values: np.ndarray) -> bool:
    """Whether a batch column holds strings (a text column)."""
    return values.dtype == object or values.dtype.kind in "US"


@dataclass(frozen=True)
class HfCall(ModelCall):
    """``model(**{feature_col: tensor}, labels=...)`` (see the module docstring)."""

    names: tuple[str, ...] = ()  # the feature columns: forward's keyword for each
    accepted: frozenset[str] = frozenset()  # forward's named parameters
    tokenizer: Any = None
    max_length: int | None = None
    long_labels: bool = False  # own loss of a classifier: labels as class indices (int64)
    output: str = "logits"

    def _tokenize(self, texts: np.ndarray) -> dict[str, torch.Tensor]:
        encoded = self.tokenizer(
            [str(t) for t in texts],
            padding="max_length",
            truncation=True,
            max_length=self.max_length,
            return_tensors="pt",
        )
        return {k: v for k, v in encoded.items() if k in self.accepted}

    def inputs(self, batch: dict[str, np.ndarray], columns: list[str]) -> Inputs:
        kwargs: dict[str, torch.Tensor] = {}
        for name, column in zip(self.names, columns, strict=True):
            values = batch[column]
            if is_text(values):
                kwargs.update(self._tokenize(values))
            elif values.dtype.kind in "iu":
                kwargs[name] = tensor(values).to(torch.int64)
            else:
                kwargs[name] = tensor(values).to(torch.float32)
        return [], kwargs

    def probe(self, shapes: list[list[int]], columns: list[str]) -> Inputs:
        """One row of token id 0 per column (a text column, shape ``[]``: an empty text)."""
        batch = {
            c: np.array([""], dtype=object) if shape == [] else np.zeros((1, *shape), np.int64)
            for c, shape in zip(columns, shapes, strict=True)
        }
        return self.inputs(batch, columns)

    def __call__(self, model: Any, inputs: Inputs, labels: list[torch.Tensor] | None = None) -> Any:
        args, kwargs = inputs
        if self.own_loss and labels is not None:
            label = labels[0]
            kwargs = {**kwargs, "labels": label.to(torch.int64) if self.long_labels else label}
        return model(*args, **kwargs)

    def outputs(self, result: Any, count: int) -> list[torch.Tensor]:
        if isinstance(result, torch.Tensor | tuple | list):
            return as_outputs(result, count)
        value = result.get(self.output) if hasattr(result, "get") else None
        if value is None:
            keys = [k for k in getattr(result, "keys", lambda: [])() if k != "loss"]
            raise ValueError(
                f"the model's output has no {self.output!r}; it has {', '.join(keys)}. Choose "
                "one with RingModel.setModelOutput(...) (default 'logits': a model with a head)."
            )
        return as_outputs(value, count)

    def loss(self, result: Any) -> torch.Tensor:
        loss = getattr(result, "loss", None)
        if loss is None:
            raise ValueError(
                "loss=None trains on the model's own loss, but the model returned none "
                "(outputs.loss is None) for a batch with labels=; set a loss (setLoss("
                "torch.nn.CrossEntropyLoss())) or use a model with a head that computes one."
            )
        loss_value: torch.Tensor = loss
        return loss_value
