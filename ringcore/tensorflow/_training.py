"""Training helpers: gradient reduction, ``DistributedGradientTape``,
``DistributedOptimizer`` for ``tf.compat.v1`` optimizers, ``broadcast_variables``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import torch as C
from .._ops import ReduceOp
from ..runtime.process_sets import ProcessSet, check_process_set, global_process_set
from ._bridge import run_op, tf, to_tf, to_torch
from ._collectives import _check_root, allreduce, grouped_allreduce
from ._compression import Compression

__all__ = [
    "DistributedGradientTape",
    "GradientReducer",
    "PartialDistributedGradientTape",
    "ReductionOptions",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object_fn",
    "broadcast_variables",
    "local_layer_variables",
    "variable_key",
]


@dataclass(frozen=True)
class ReductionOptions:
    """How gradients are reduced over the ranks: the Horovod keyword arguments that
    ``DistributedOptimizer``, ``DistributedGradientTape`` and Keras' ``load_model``
    share, validated once here."""

    compression: Any = Compression.none
    sparse_as_dense: bool = False
    op: Any = ReduceOp.Average
    gradient_predivide_factor: float = 1.0
    num_groups: int = 0
    groups: Any = None
    process_set: ProcessSet = global_process_set
    scale_local_gradients: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "op", ReduceOp(int(self.op)))
        if self.groups is not None:
            raise NotImplementedError(
                "groups= is not supported by ringcore.tensorflow yet; use num_groups=N "
                "(gradients split into N fused groups) or leave both unset (one group)."
            )
        if not isinstance(self.num_groups, int) or self.num_groups < 0:
            raise ValueError(f"num_groups must be an integer >= 0, got {self.num_groups!r}")
        if self.gradient_predivide_factor != 1.0 and self.op != ReduceOp.Average:
            raise ValueError(
                f"gradient_predivide_factor={self.gradient_predivide_factor} needs "
                f"op=Average, got op={self.op.name}"
            )


class GradientReducer:
    """Averages a list of gradients over the ranks, as Horovod's TF bindings do: dense
    gradients in ``num_groups`` fused groups (one group by default), ``IndexedSlices``
    gathered (or made dense first with ``sparse_as_dense``); ``None`` passes through.
    ``prescale_factor`` multiplies them first (Keras' accumulated steps)."""

    def __init__(self, options: ReductionOptions, prescale_factor: float = 1.0):
        self.options, self.prescale = options, float(prescale_factor)

    def _scales(self, prescale: bool = True) -> tuple[ReduceOp, float, float]:
        pre = self.prescale if prescale else 1.0
        predivide = float(self.options.gradient_predivide_factor)
        if predivide != 1.0:  # Horovod: sum the pre-divided values, scale after
            n = (self.options.process_set or global_process_set).size()
            return ReduceOp.Sum, pre / predivide, predivide / n
        return self.options.op, pre, 1.0

    def scale(self, grads: list[Any]) -> list[Any]:
        """``grads`` (reduced already) times ``prescale_factor``, without communication."""
        return [_scaled(g, self.prescale) for g in grads]

    def reduce(
        self, grads: list[Any], local: list[bool] | None = None, prescale: bool = True
    ) -> list[Any]:
        """``grads`` reduced over the ranks, but those where ``local`` is true: they are
        only divided by the number of ranks (Horovod's ``scale_local_gradients``)."""
        o = self.options
        check_process_set(o.process_set, "DistributedGradientTape")
        n = (o.process_set or global_process_set).size()
        grads = list(grads)
        local = list(local) if local is not None else [False] * len(grads)
        if n == 1 and (self.prescale == 1.0 or not prescale):
            return grads
        if o.sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        op, pre, post = self._scales(prescale)
        out: list[Any] = list(grads)
        shared = [i for i, g in enumerate(grads) if g is not None and not local[i]]
        dense = [i for i in shared if not isinstance(grads[i], tf.IndexedSlices)]
        for part in _split(dense, o.num_groups):
            reduced = grouped_allreduce(
                [grads[i] for i in part],
                compression=o.compression,
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=o.process_set,
            )
            for i, r in zip(part, reduced, strict=True):
                out[i] = r
        for i in shared:
            if isinstance(grads[i], tf.IndexedSlices):
                sparse_op = ReduceOp.Sum if op == ReduceOp.Sum else ReduceOp.Average
                reduced = allreduce(grads[i], op=sparse_op, process_set=o.process_set)
                out[i] = _scaled(reduced, pre * post)
        kept = self.prescale if prescale else 1.0  # the local ones: no predivide to undo
        for i, g in enumerate(grads):
            if local[i] and g is not None:
                out[i] = _scaled(g, kept / n if o.scale_local_gradients else kept)
        return out


def _scaled(grad: Any, factor: float) -> Any:
    if grad is None or factor == 1.0:
        return grad
    if isinstance(grad, tf.IndexedSlices):
        values = grad.values * tf.cast(factor, grad.values.dtype)
        return tf.IndexedSlices(values, grad.indices, grad.dense_shape)
    return grad * tf.cast(factor, grad.dtype)


def variable_key(var: Any) -> Any:
    """A hashable key for a variable, the same for a Keras 3 variable and the
    ``tf.Variable`` it holds (Keras 3 variables have no ``ref()``)."""
    inner = getattr(var, "_value", None)
    if isinstance(inner, tf.Variable):
        var = inner
    return var.ref() if hasattr(var, "ref") else id(var)


def _split(indices: list[int], groups: int) -> list[list[int]]:
    if not indices:
        return []
    if groups <= 1:
        return [indices]
    size = -(-len(indices) // groups)
    return [indices[i : i + size] for i in range(0, len(indices), size)]


class DistributedGradientTape:
    """Wraps a ``tf.GradientTape``: ``gradient()`` returns the gradients averaged over
    the ranks (Horovod's ``hvd.DistributedGradientTape``). Every other attribute is the
    tape's own."""

    def __init__(
        self,
        gradtape: Any,
        device_dense: str = "",
        device_sparse: str = "",
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = ReduceOp.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: ProcessSet = global_process_set,
        scale_local_gradients: bool = True,
    ):
        if not isinstance(gradtape, tf.GradientTape):
            raise TypeError(
                f"DistributedGradientTape wraps a tf.GradientTape, got {type(gradtape).__name__}"
            )
        self._tape = gradtape
        self._reducer = GradientReducer(
            ReductionOptions(
                compression=compression,
                sparse_as_dense=sparse_as_dense,
                op=op,
                gradient_predivide_factor=gradient_predivide_factor,
                num_groups=num_groups,
                groups=groups,
                process_set=process_set,
                scale_local_gradients=scale_local_gradients,
            )
        )
        self._local_sources: set[Any] = set()

    def register_local_source(self, source: Any) -> None:
        """Keep ``source``'s gradient local (model parallelism): it is not reduced over
        the ranks, only divided by their number unless ``scale_local_gradients=False``."""
        self._local_sources.add(variable_key(source))

    def gradient(
        self,
        target,
        sources,
        output_gradients=None,
        unconnected_gradients=None,
        use_generic_names=False,
    ):
        kwargs = (
            {}
            if unconnected_gradients is None
            else {"unconnected_gradients": unconnected_gradients}
        )
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        local = None
        if self._local_sources:
            local = [variable_key(s) in self._local_sources for s in tf.nest.flatten(sources)]
        return tf.nest.pack_sequence_as(grads, self._reducer.reduce(flat, local=local))

    def get_local_and_global_gradients(
        self, target, sources, output_gradients=None, use_generic_names=False
    ) -> tuple[list[tuple[Any, Any]], list[tuple[Any, Any]]]:
        """``gradient(target, sources)`` as two lists of ``(source, gradient)``: the
        local sources' and the others'."""
        sources = list(tf.nest.flatten(sources))
        grads = self.gradient(target, sources, output_gradients)
        local: list[tuple[Any, Any]] = []
        shared: list[tuple[Any, Any]] = []
        for s, g in zip(sources, grads, strict=True):
            (local if variable_key(s) in self._local_sources else shared).append((s, g))
        return local, shared

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


def PartialDistributedGradientTape(
    gradtape: Any,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    op: Any = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    local_layers: Any = None,
    scale_local_gradients: bool = True,
) -> DistributedGradientTape:
    """A ``DistributedGradientTape`` whose ``local_layers`` (a Keras layer or a list of
    them) keep their gradients local, as registered with ``register_local_source``."""
    tape = DistributedGradientTape(
        gradtape,
        device_dense,
        device_sparse,
        compression,
        sparse_as_dense,
        op,
        gradient_predivide_factor,
        num_groups,
        groups,
        process_set,
        scale_local_gradients,
    )
    for var in local_layer_variables(local_layers):
        tape.register_local_source(var)
    return tape


def local_layer_variables(local_layers: Any) -> list[Any]:
    """The trainable variables of ``local_layers`` (None, a Keras layer or a list)."""
    import keras

    if local_layers is None:
        return []
    if isinstance(local_layers, keras.layers.Layer):
        local_layers = [local_layers]
    local_layers = list(local_layers)
    wrong = [type(x).__name__ for x in local_layers if not isinstance(x, keras.layers.Layer)]
    if wrong:
        raise ValueError(
            f"local_layers must be Keras layers, got {', '.join(wrong)}; pass model.layers[i]"
        )
    return [var for layer in local_layers for var in layer.trainable_weights]


def broadcast_variables(
    variables: Any,
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> Any:
    """Assign rank ``root_rank``'s value to every variable in ``variables`` on every rank
    (all broadcasts in flight at once)."""
    variables = list(variables)
    if not variables:  # nothing to send: no collective, so no need of init() either
        return tf.no_op() if not tf.executing_eagerly() else None
    check_process_set(process_set, "broadcast_variables")
    _check_root(root_rank, process_set)

    def eager(*values):
        handles = [C.broadcast_async(to_torch(v), root_rank, None, process_set) for v in values]
        return [to_tf(C.synchronize(h)) for h in handles]

    values = [tf.convert_to_tensor(v) for v in variables]
    dtypes, shapes = [v.dtype for v in values], [v.shape for v in values]
    received = run_op(eager, values, dtypes, "RingBroadcastVariables", shape=shapes)
    assigns = [v.assign(r) for v, r in zip(variables, received, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigns)


def broadcast_(
    variables: Any, root_rank: int, name: str | None = None, process_set=global_process_set
) -> list[Any]:
    """Horovod's in-place broadcast: every variable of the list takes rank
    ``root_rank``'s value; returns the variables' new values, in order."""
    variables = list(variables)
    check_process_set(process_set, "broadcast_")
    _check_root(root_rank, process_set)
    names = [None if name is None else f"{name}.{i}" for i in range(len(variables))]

    def eager(*values):
        handles = [
            C.broadcast_async(to_torch(v), root_rank, n, process_set)
            for v, n in zip(values, names, strict=True)
        ]
        return [to_tf(C.synchronize(h)) for h in handles]

    if not variables:
        return []
    values = [tf.convert_to_tensor(v) for v in variables]
    dtypes, shapes = [v.dtype for v in values], [v.shape for v in values]
    received = run_op(eager, values, dtypes, "RingBroadcastInPlace", shape=shapes)
    return [v.assign(r) for v, r in zip(variables, received, strict=True)]


def broadcast_global_variables(root_rank: int) -> Any:
    """Broadcast TF1's global variables (graph mode only, as Horovod): in eager mode
    there is no such collection, so this raises ``RuntimeError``."""
    if tf.executing_eagerly():
        raise RuntimeError(
            "broadcast_global_variables() needs graph mode (TensorFlow 1 global variables); "
            "in eager mode call broadcast_variables(model.variables, root_rank) instead"
        )
    return broadcast_variables(tf.compat.v1.global_variables(), root_rank)


def broadcast_object_fn(
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """A function ``fn(obj)`` that returns rank ``root_rank``'s ``obj`` on every rank."""

    def broadcast(obj: Any) -> Any:
        return C.broadcast_object(obj, root_rank, name, process_set)

    return broadcast
