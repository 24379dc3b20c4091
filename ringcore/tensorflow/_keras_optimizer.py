"""``DistributedOptimizer`` for Keras 3 (TensorFlow backend): ``ringcore.keras`` exports
it, and ``ringcore.tensorflow.DistributedOptimizer`` hands a Keras optimizer to it; it
lives in the TensorFlow binding that both build on, so neither imports the other.

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

As Horovod's, the optimizer also computes gradients itself (``_compute_gradients`` /
``compute_gradients``, which Keras 3 optimizers lack): those come back reduced, and
the ``apply_gradients`` that follows does not reduce them again. Variables given to
``register_local_var`` (or the layers of ``PartialDistributedOptimizer``) keep a
local gradient, divided by the number of ranks.
"""

from __future__ import annotations

from typing import Any

import keras

from .._ops import ReduceOp
from ..runtime.process_sets import ProcessSet, global_process_set
from ._bridge import tf
from ._compression import Compression
from ._training import GradientReducer, ReductionOptions, local_layer_variables, variable_key

__all__ = [
    "DistributedOptimizer",
    "PartialDistributedOptimizer",
    "is_distributed",
    "wrap_in_place",
]

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
    namespace = {name: value for name, value in _Distributed.__dict__.items() if callable(value)}
    namespace.update({"__module__": base.__module__, "_ring_base": base})
    cls: Any = type(base.__name__, (base,), namespace)
    cls.__qualname__ = base.__qualname__
    _classes[base] = cls
    return cls


class _Step:
    """What a distributed optimizer keeps between its own calls, in one plain object:
    Keras tracks the lists and variables set as an optimizer's attributes (and would
    save them with its state), never the inside of an object like this."""

    def __init__(self) -> None:
        self.local: set[Any] = set()  # variable_key of the variables kept local
        self.pre_reduced = False  # the next apply gets gradients _compute_gradients reduced
        self.skip_reduce = False  # inside that apply
        self.variables: list[Any] | None = None  # inside _backend_apply_gradients


class _Distributed:
    """The methods a distributed optimizer adds to (or puts over) its base class's;
    ``_distributed_class`` copies them into the subclass it makes, so that ``super()``
    inside them is written as an explicit call on ``self._ring_base``."""

    _ring_base: Any
    _ring_reducer: GradientReducer

    def register_local_var(self: Any, var: Any) -> None:
        """Keep ``var``'s gradient local: it is not reduced over the ranks (only
        divided by their number, as Horovod's ``scale_local_gradients``)."""
        self._ring_step().local.add(variable_key(var))

    def compute_gradients(self: Any, loss: Any, var_list: Any, tape: Any = None) -> Any:
        return self._compute_gradients(loss, var_list, None, tape)

    def _compute_gradients(
        self: Any, loss: Any, var_list: Any, grad_loss: Any = None, tape: Any = None
    ) -> list[tuple[Any, Any]]:
        """The ``(gradient, variable)`` pairs of ``loss`` (a tensor recorded on
        ``tape``, or a callable run under a new tape), reduced over the ranks; the next
        ``apply_gradients`` applies them without reducing them again."""
        if callable(var_list):
            var_list = var_list()
        var_list = list(tf.nest.flatten(var_list))
        if callable(loss):
            tape = tape if tape is not None else tf.GradientTape()
            with tape:
                loss = loss()
        elif tape is None:
            raise ValueError(
                "_compute_gradients got a loss tensor without tape=: pass the "
                "tf.GradientTape that recorded it, or a callable loss"
            )
        grads = tape.gradient(loss, var_list, grad_loss)
        reduced = self._ring_reducer.reduce(
            list(grads), local=self._ring_local_mask(var_list), prescale=False
        )
        self._ring_step().pre_reduced = True
        return list(zip(reduced, var_list, strict=True))

    def apply_gradients(
        self: Any, grads_and_vars: Any, name: Any = None, experimental_aggregate_gradients=True
    ) -> Any:
        # ``name`` and ``experimental_aggregate_gradients`` are tf.keras 2's arguments,
        # accepted so that code written for Horovod on Keras 2 runs unchanged.
        return self._ring_base.apply_gradients(self, list(grads_and_vars))

    def apply(self: Any, grads: Any, trainable_variables: Any = None) -> Any:
        step = self._ring_step()
        if self._ring_reducer.options.sparse_as_dense:  # before Keras adds them up (accumulation)
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        step.skip_reduce, step.pre_reduced = step.pre_reduced, False
        try:
            return self._ring_base.apply(self, grads, trainable_variables)
        finally:
            step.skip_reduce = False

    def _backend_apply_gradients(self: Any, grads: Any, trainable_variables: Any) -> Any:
        step = self._ring_step()
        step.variables = list(trainable_variables)
        try:
            return self._ring_base._backend_apply_gradients(self, grads, trainable_variables)
        finally:
            step.variables = None

    def _clip_gradients(self: Any, grads: list[Any]) -> list[Any]:
        if _in_xla():
            raise RuntimeError(
                "ringcore.keras.DistributedOptimizer cannot run inside an XLA-compiled step; "
                "compile the model with jit_compile=False."
            )
        step = self._ring_step()
        if step.skip_reduce:  # reduced by _compute_gradients already
            reduced = self._ring_reducer.scale(list(grads))
        else:
            local = self._ring_local_mask(step.variables) if step.variables else None
            reduced = self._ring_reducer.reduce(list(grads), local=local)
        return self._ring_base._clip_gradients(self, reduced)

    def _ring_step(self: Any) -> _Step:
        step = self.__dict__.get("_ring_step_state")
        if step is None:
            step = self._ring_step_state = _Step()
        return step

    def _ring_local_mask(self: Any, variables: list[Any]) -> list[bool] | None:
        local = self._ring_step().local
        if not local:
            return None
        return [variable_key(v) in local for v in variables]


def is_distributed(optimizer: Any) -> bool:
    return getattr(type(optimizer), "_ring_base", None) is not None


def _reducer(
    options: ReductionOptions, steps: int, average_aggregated_gradients: bool
) -> GradientReducer:
    """Keras adds up ``steps`` accumulated gradients; Horovod averages them unless
    ``average_aggregated_gradients`` (Keras then averages them itself)."""
    prescale = 1.0 if steps == 1 or average_aggregated_gradients else float(steps)
    return GradientReducer(options, prescale_factor=prescale)


def wrap_in_place(
    optimizer: Any, options: ReductionOptions, average_aggregated_gradients: bool = False
) -> Any:
    """Make an existing optimizer (its variables and state kept) distributed — what
    ``load_model`` does to the optimizer of a loaded model."""
    if is_distributed(optimizer):
        return optimizer
    steps = optimizer.gradient_accumulation_steps or 1
    optimizer.__class__ = _distributed_class(type(optimizer))
    optimizer._ring_reducer = _reducer(options, steps, average_aggregated_gradients)
    return optimizer


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
    options = ReductionOptions(
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        op=op,
        gradient_predivide_factor=gradient_predivide_factor,
        num_groups=num_groups,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
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
    wrapped._ring_reducer = _reducer(options, steps, average_aggregated_gradients)
    return wrapped


def PartialDistributedOptimizer(
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
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> Any:
    """A ``DistributedOptimizer`` whose ``local_layers`` (a Keras layer or a list of
    them) keep their gradients local (registered with ``register_local_var``)."""
    wrapped = DistributedOptimizer(
        optimizer,
        name=name,
        compression=compression,
        sparse_as_dense=sparse_as_dense,
        gradient_predivide_factor=gradient_predivide_factor,
        op=op,
        backward_passes_per_step=backward_passes_per_step,
        average_aggregated_gradients=average_aggregated_gradients,
        groups=groups,
        process_set=process_set,
        scale_local_gradients=scale_local_gradients,
    )
    for var in local_layer_variables(local_layers):
        wrapped.register_local_var(var)
    return wrapped
