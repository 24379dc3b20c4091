"""``DistributedOptimizer`` for Keras 3 (TensorFlow backend).

The wrapped optimizer is an instance of a subclass of the user's optimizer class
(same name, same module, same config), so ``model.compile`` / ``model.fit`` and
``model.save`` treat it as the original; a saved model loads anywhere as the
plain optimizer, and :func:`ringcore.keras.load_model` wraps it again.

The gradients are reduced where Keras applies them: its ``_clip_gradients`` step,
which runs once per update, after the loss-scale is undone and before clipping,
weight decay and the update (so clipping sees the averaged gradient, as with
Horovod). ``backward_passes_per_step=N`` uses Keras's own gradient accumulation
(``gradient_accumulation_steps=N``): gradients add up locally for N batches and
one allreduce runs per update. Keras averages the accumulated gradients; with
``average_aggregated_gradients=False`` (Horovod's default) they are summed, so
they are scaled back by N.
"""

from __future__ import annotations

from typing import Any

import keras

from .._ops import ReduceOp
from .._process_sets import ProcessSet, global_process_set
from ..tensorflow._bridge import tf
from ..tensorflow._compression import Compression
from ..tensorflow._training import GradientReducer

__all__ = ["DistributedOptimizer", "is_distributed", "wrap_in_place"]

_classes: dict[Any, Any] = {}


def _in_xla() -> bool:
    try:
        from tensorflow.python.ops import control_flow_util

        return bool(control_flow_util.GraphOrParentsInXlaContext(tf.compat.v1.get_default_graph()))
    except Exception:
        return False


def _distributed_class(base: Any) -> Any:
    if base in _classes:
        return _classes[base]

    def _clip_gradients(self: Any, grads: list[Any]) -> list[Any]:
        if _in_xla():
            raise RuntimeError(
                "ringcore.keras.DistributedOptimizer cannot run inside an XLA-compiled step; "
                "compile the model with jit_compile=False."
            )
        reduced = self._ring_reducer.reduce(list(grads))
        return base._clip_gradients(self, reduced)

    cls: Any = type(
        base.__name__,
        (base,),
        {"_clip_gradients": _clip_gradients, "__module__": base.__module__, "_ring_base": base},
    )
    cls.__qualname__ = base.__qualname__
    _classes[base] = cls
    return cls


def is_distributed(optimizer: Any) -> bool:
    return getattr(type(optimizer), "_ring_base", None) is not None


def _reducer(
    compression,
    sparse_as_dense,
    op,
    gradient_predivide_factor,
    num_groups,
    groups,
    process_set,
    steps,
    average_aggregated_gradients,
) -> GradientReducer:
    prescale = 1.0 if steps == 1 or average_aggregated_gradients else float(steps)
    return GradientReducer(
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        prescale_factor=prescale,
    )


def wrap_in_place(optimizer: Any, **kwargs: Any) -> Any:
    """Make an existing optimizer (its variables and state kept) distributed — what
    ``load_model`` does to the optimizer of a loaded model."""
    if is_distributed(optimizer):
        return optimizer
    steps = optimizer.gradient_accumulation_steps or 1
    optimizer.__class__ = _distributed_class(type(optimizer))
    optimizer._ring_reducer = _reducer(steps=steps, **_reducer_kwargs(**kwargs))
    return optimizer


def _reducer_kwargs(
    compression=Compression.none,
    sparse_as_dense=False,
    op=ReduceOp.Average,
    gradient_predivide_factor=1.0,
    num_groups=0,
    groups=None,
    process_set=global_process_set,
    average_aggregated_gradients=False,
) -> dict[str, Any]:
    return {
        "compression": compression,
        "sparse_as_dense": sparse_as_dense,
        "op": op,
        "gradient_predivide_factor": gradient_predivide_factor,
        "num_groups": num_groups,
        "groups": groups,
        "process_set": process_set,
        "average_aggregated_gradients": average_aggregated_gradients,
    }


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    gradient_predivide_factor: float = 1.0,
    op: Any = ReduceOp.Average,
    backward_passes_per_step: int = 1,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """A new optimizer like ``optimizer`` (built from its config) whose gradients are
    averaged over the ranks before each update; use it in ``model.compile``."""
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise TypeError(
            f"DistributedOptimizer wraps a keras.optimizers.Optimizer, got {type(optimizer).__name__}"
        )
    if is_distributed(optimizer):
        raise ValueError("this optimizer is already a DistributedOptimizer; wrap the original once")
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step < 1:
        raise ValueError(
            f"backward_passes_per_step must be an integer >= 1, got {backward_passes_per_step!r}"
        )
    config = optimizer.get_config()
    if name is not None:
        config["name"] = name
    if backward_passes_per_step > 1:
        if config.get("gradient_accumulation_steps"):
            raise ValueError(
                "the optimizer already has gradient_accumulation_steps="
                f"{config['gradient_accumulation_steps']}; pass backward_passes_per_step or "
                "gradient_accumulation_steps, not both"
            )
        config["gradient_accumulation_steps"] = backward_passes_per_step
    wrapped = _distributed_class(type(optimizer)).from_config(config)
    steps = wrapped.gradient_accumulation_steps or 1
    wrapped._ring_reducer = _reducer(
        steps=steps,
        **_reducer_kwargs(
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            num_groups,
            groups,
            process_set,
            average_aggregated_gradients,
        ),
    )
    return wrapped
