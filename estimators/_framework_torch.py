"""torch ``nn.Module`` models: the :class:`~estimators._frameworks.Framework` for ``"torch"``.

- **Params.** The optimizer is a ``torch.optim.Optimizer`` built on the model's own
  parameters; the loss is a callable ``loss(output, label)``.
- **First batch.** Two rows of the data go through ``transformation_fn``, the model (in
  eval mode, without gradients; its mode is restored) and the loss on the driver, so a
  loss that does not fit the label's shape fails there, naming both shapes, instead of
  inside torch on a worker.
- **Workers.** ``_train_torch.train`` with a :class:`~estimators._train_torch.TrainSpec`:
  the model, the optimizer's class, param groups and state, cloudpickled.
- **Checkpoint, transform, save.** The run's ``checkpoint.pt`` holds the state_dict;
  ``transform`` predicts in Arrow batches (``_predict_torch``); ``save`` writes the
  weights (``torch.save``) and the module's structure (cloudpickle, on the ``meta``
  device) under ``<path>/model/`` (layout: ``_persistence``).

:class:`TorchFramework` is also the base of the Lightning one: a LightningModule is an
``nn.Module``, and loads, predicts and saves as one.
"""

from __future__ import annotations

import copy
import io
import posixpath
import warnings
from dataclasses import dataclass, replace
from typing import Any

import cloudpickle
import fsspec
import numpy as np
import torch

from ._checkpoints import read_checkpoint
from ._frameworks import TORCH, Predictor
from ._knobs import TrainingKnobs, scheduler_payload
from ._metrics import resolve_metrics
from ._predict_torch import torch_predictor
from ._spec import data_spec_fields
from ._train_torch import TrainSpec, _as_target, _per_row_loss, as_outputs, to_inputs, train

__all__ = ["FRAMEWORK", "TorchFramework", "load_module", "save_module"]


@dataclass(frozen=True)
class TorchFramework:
    """The torch ``nn.Module`` framework (see the module docstring)."""

    name: str = TORCH
    pickles_model: bool = True

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        _check_torch(model, optimizer, loss)
        resolve_metrics(metrics)

    def check_first_batch(self, cfg: Any, batch: dict[str, Any]) -> None:
        if cfg.loss is not None:
            _check_first_batch(cfg, batch)

    def check_prepared(self, cfg: Any, data: Any) -> None:
        """Nothing left: the first batch went through the model and the loss already."""

    def worker(self, cfg: Any, data: Any) -> tuple[Any, tuple]:
        return train, (train_spec(cfg, data, lightning=False),)

    def load_checkpoint(self, cfg: Any) -> torch.nn.Module:
        raw = read_checkpoint(cfg.store, cfg.run_id)  # the newest whole one: a torn one is passed
        # map_location: a checkpoint of an older run may hold CUDA tensors; the driver may have no GPU
        checkpoint = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        model = copy.deepcopy(cfg.model)
        best = checkpoint.get("best")
        knobs = getattr(cfg, "knobs", None)
        restore_best = knobs is not None and knobs.restore_best_weights and best is not None
        model.load_state_dict(best["model"] if restore_best else checkpoint["model"])
        model.eval()
        return model

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

    def save_model(self, model: Any, path: str) -> None:
        save_module(model, path)

    def load_model(self, path: str) -> Any:
        return load_module(path)


# --- params ------------------------------------------------------------------------------------


def _check_torch(model: Any, optimizer: Any, loss: Any) -> None:
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
    if not callable(loss):
        raise ValueError(
            f"loss must be callable as loss(output, label), got {type(loss).__name__}. "
            "Set it with setLoss(torch.nn.CrossEntropyLoss()), for example."
        )


# --- the workers' spec -------------------------------------------------------------------------


def _optimizer_groups(model: torch.nn.Module, optimizer: Any) -> list[list[int]]:
    if optimizer is None:  # a LightningModule: configure_optimizers() on every worker
        return []
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def train_spec(cfg: Any, data: Any, lightning: bool) -> TrainSpec:
    """The :class:`TrainSpec` of a fit of ``cfg`` on ``data`` (``lightning``: the model
    brings its own ``configure_optimizers`` / ``training_step``)."""
    optimizer_cls = type(cfg.optimizer) if cfg.optimizer is not None else None
    knobs = getattr(cfg, "knobs", None) or TrainingKnobs()  # a config made by hand: none
    loop_objects = (
        knobs.loss_constructors,
        scheduler_payload(knobs.lr_scheduler),
        knobs.train_minibatch_fn,
    )
    return TrainSpec(
        user_objects=cloudpickle.dumps(
            (cfg.model, optimizer_cls, cfg.loss, cfg.metrics, cfg.callbacks)
        ),
        optimizer_groups=_optimizer_groups(cfg.model, cfg.optimizer),
        optimizer_state=cfg.optimizer.state_dict() if cfg.optimizer is not None else {},
        **data_spec_fields(cfg, data),
        lightning=lightning,
        use_gpu=cfg.use_gpu,
        inmemory_cache_all=cfg.inmemory_cache_all,
        # the callables travel in loop_objects (cloudpickle), the plain values in knobs
        knobs=replace(knobs, loss_constructors=None, lr_scheduler=None, train_minibatch_fn=None),
        loop_objects=cloudpickle.dumps(loop_objects) if any(loop_objects) else b"",
    )


# --- a first batch through the model and the loss ---------------------------------------------


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
                value = _per_row_loss(cfg.loss, output, target)
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


def _check_first_batch(cfg: Any, batch: dict[str, np.ndarray]) -> None:
    """Run ``batch`` (a few rows) through ``transformation_fn``, the model and the loss."""
    batch = _transformed(cfg, batch)
    model, training = cfg.model, cfg.model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = to_inputs(batch, cfg.feature_cols)
            try:
                result = model(*inputs)
            except Exception as exc:
                shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
                raise ValueError(
                    f"the model {type(model).__name__} failed on a first batch: forward got "
                    f"{len(inputs)} input(s) of shape {shapes} (feature_cols "
                    f"{cfg.feature_cols}, in that order) and raised {type(exc).__name__}: {exc}. "
                    "Make forward take those inputs, or change feature_cols (setFeatureCols)."
                ) from exc
            outputs = as_outputs(result, len(cfg.label_cols))
            for output, label in zip(outputs, cfg.label_cols, strict=True):
                target = _as_target(output, torch.from_numpy(np.array(batch[label])))
                _call_loss(cfg, output, target, label)
    finally:
        model.train(training)


# --- RingModel.save / load ---------------------------------------------------------------------


def _join(path: str, *parts: str) -> str:
    return posixpath.join(path.rstrip("/"), *parts)


def _extra_buffers(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Buffers ``state_dict`` leaves out (registered with ``persistent=False``)."""
    saved = module.state_dict()
    return {
        name: buf.detach().clone()
        for name, buf in module.named_buffers()
        if name not in saved and buf is not None
    }


def _structure(module: torch.nn.Module) -> bytes:
    """The module without its weights: a copy on the ``meta`` device, cloudpickled."""
    skeleton = copy.deepcopy(module).to("meta")
    return cloudpickle.dumps(skeleton)


def save_module(module: torch.nn.Module, path: str) -> None:
    """``<path>/model/weights.pt`` (state_dict + non-persistent buffers) and ``module.pkl``."""
    weights = io.BytesIO()
    torch.save(
        {"state_dict": module.state_dict(), "extra_buffers": _extra_buffers(module)}, weights
    )
    with fsspec.open(_join(path, "model", "weights.pt"), "wb") as f:
        f.write(weights.getvalue())
    with fsspec.open(_join(path, "model", "module.pkl"), "wb") as f:
        f.write(_structure(module))


def load_module(path: str) -> torch.nn.Module:
    with fsspec.open(_join(path, "model", "module.pkl"), "rb") as f:
        module = cloudpickle.loads(f.read())
    with fsspec.open(_join(path, "model", "weights.pt"), "rb") as f:
        saved = torch.load(io.BytesIO(f.read()), weights_only=True)
    module = module.to_empty(device="cpu")
    module.load_state_dict(saved["state_dict"], strict=True)
    for name, value in saved["extra_buffers"].items():
        owner, _, attr = name.rpartition(".")
        module.get_submodule(owner).register_buffer(attr, value, persistent=False)
    module.eval()
    return module


FRAMEWORK = TorchFramework()
