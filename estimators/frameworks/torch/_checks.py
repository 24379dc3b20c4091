"""The torch framework's checks on the driver: the params, and a first batch.

- **Params.** The optimizer is a ``torch.optim.Optimizer`` built on the model's own
  parameters; the loss is a callable ``loss(output, label)``.
- **First batch.** Two rows of the data go through ``transformation_fn``, the model (in
  eval mode, without gradients; its mode is restored) and the loss on the driver, so a
  loss that does not fit the label's shape fails there, naming both shapes, instead of
  inside torch on a worker.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from ._calling import ModelCall
from ._losses import per_row_loss
from ._tensors import as_target, tensor

__all__ = ["check_first_batch", "check_torch_params"]


def check_torch_params(model: Any, optimizer: Any, loss: Any, own_loss: bool = False) -> None:
    """The optimizer is built on ``model``'s parameters; the loss is callable (unless the
    model computes its own: ``own_loss``)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ValueError(
            f"optimizer must be a torch.optim.Optimizer built on model.parameters(), got "
            f"{type(optimizer).__name__}. Set it with setOptimizer(torch.optim.Adam(model.parameters()))."
        )
    known = {id(p) for p in model.parameters()}
    foreign = sum(1 for g in optimizer.param_groups for p in g["params"] if id(p) not in known)
    if foreign:
        raise ValueError(
            f"the optimizer holds {foreign} parameter(s) that are not in the model; build it on "
            "model.parameters() of the model you pass as model."
        )
    if own_loss:
        return
    if loss is None:
        raise ValueError(
            f"loss is not set (loss=None), and the model {type(model).__name__} computes no "
            "loss of its own (only a Hugging Face model with a head does, given labels=). Set "
            "one with setLoss(torch.nn.CrossEntropyLoss()), for example."
        )
    if not callable(loss):
        raise ValueError(
            f"loss must be callable as loss(output, label), got {type(loss).__name__}. "
            "Set it with setLoss(torch.nn.CrossEntropyLoss()), for example."
        )


def _shapes(batch: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {tuple(np.shape(v))}" for k, v in batch.items())


def _loss_name(loss: Any) -> str:
    return getattr(loss, "__name__", None) or type(loss).__name__


def _call_loss(cfg: Any, output: torch.Tensor, target: torch.Tensor, label: str) -> None:
    name = _loss_name(cfg.loss)
    shapes = (
        f"the model's output of shape {tuple(output.shape)} ({output.dtype}) and label column "
        f"{label!r} of shape {tuple(target.shape)} ({target.dtype})"
    )
    fix = (
        "Make the model return, per label column, what this loss takes (e.g. (rows, classes) "
        "logits for class-index labels with CrossEntropyLoss; the label's shape with MSELoss), "
        "or choose a loss for this label with setLoss(...)."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if cfg.sample_weight_col is not None:
                value = per_row_loss(cfg.loss, output, target)
            else:
                value = cfg.loss(output, target)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ValueError(
                f"the loss {name} does not fit the label: on a first batch it got {shapes} and "
                f"raised {type(exc).__name__}: {reason}. {fix}"
            ) from exc
    sizes = [w for w in caught if "size" in str(w.message) and "target" in str(w.message)]
    if sizes:
        raise ValueError(
            f"the loss {name} does not fit the label: on a first batch it got {shapes} and would "
            f"broadcast them ({sizes[0].message}). {fix}"
        )
    if cfg.sample_weight_col is None and (
        not isinstance(value, torch.Tensor) or value.numel() != 1
    ):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"the loss {name} returned {shape} for a first batch ({shapes}), not one number. "
            "Return the batch's mean (e.g. reduction='mean') from the loss set with setLoss(...)."
        )


def _transformed(cfg: Any, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    if cfg.transformation_fn is None:
        return batch
    try:
        return cfg.transformation_fn(dict(batch))
    except Exception as exc:
        raise ValueError(
            f"transformation_fn failed on a first batch ({_shapes(batch)}): "
            f"{type(exc).__name__}: {exc}. It takes and returns a dict of numpy arrays, one "
            "per column; fix it and pass it again with setTransformationFn(...)."
        ) from exc


def _shapes_of(inputs: Any) -> str:
    """``2 input(s) of shape (2, 4), (2, 1)``; by name: ``input_ids of shape (2, 8), ...``."""
    args, kwargs = inputs
    shapes = [f"{k} of shape {tuple(v.shape)}" for k, v in kwargs.items()]
    if args:
        listed = ", ".join(str(tuple(t.shape)) for t in args)
        shapes.insert(0, f"{len(args)} input(s) of shape {listed}")
    return ", ".join(shapes)


def check_first_batch(
    cfg: Any, batch: dict[str, np.ndarray], call: ModelCall | None = None
) -> None:
    """Run ``batch`` (a few rows) through ``transformation_fn``, the model (as ``call``
    calls it) and the loss (the ``loss`` param's, or the model's own)."""
    call = call or ModelCall()
    batch = _transformed(cfg, batch)
    model, training = cfg.model, cfg.model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = call.inputs(batch, cfg.feature_cols)
            labels = [tensor(np.array(batch[label])) for label in cfg.label_cols]
            try:
                result = call(model, inputs, labels)
            except Exception as exc:
                raise ValueError(
                    f"the model {type(model).__name__} failed on a first batch: forward got "
                    f"{_shapes_of(inputs)} (feature_cols {cfg.feature_cols}, in that order) "
                    f"and raised {type(exc).__name__}: {exc}. Make forward take those inputs, "
                    "or change feature_cols (setFeatureCols)."
                ) from exc
            outputs = call.outputs(result, len(cfg.label_cols))
            if call.own_loss:
                call.loss(result)  # raises naming the fix where the model returns none
                return
            for output, label, value in zip(outputs, cfg.label_cols, labels, strict=True):
                _call_loss(cfg, output, as_target(output, value), label)
    finally:
        model.train(training)
