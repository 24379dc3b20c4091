"""Training helpers: gradient reduction, ``DistributedGradientTape``,
``DistributedOptimizer`` for ``tf.compat.v1`` optimizers, ``broadcast_variables``."""

from __future__ import annotations

from typing import Any

from .._ops import ReduceOp
from .._process_sets import ProcessSet, check_process_set, global_process_set
from ..torch import _collectives as C
from ._bridge import run_op, tf, to_tf, to_torch
from ._collectives import _check_root, allreduce, grouped_allreduce
from ._compression import Compression

__all__ = ["DistributedGradientTape", "GradientReducer", "broadcast_variables"]


class GradientReducer:
    """Averages a list of gradients over the ranks, as Horovod's TF bindings do: dense
    gradients in ``num_groups`` fused groups (one group by default), ``IndexedSlices``
    gathered (or made dense first with ``sparse_as_dense``); ``None`` passes through."""

    def __init__(
        self,
        compression: Any = Compression.none,
        sparse_as_dense: bool = False,
        op: Any = ReduceOp.Average,
        gradient_predivide_factor: float = 1.0,
        num_groups: int = 0,
        groups: Any = None,
        process_set: ProcessSet = global_process_set,
        prescale_factor: float = 1.0,
    ):
        self.op = ReduceOp(int(op))
        if groups is not None:
            raise NotImplementedError(
                "groups= is not supported by ringcore.tensorflow yet; use num_groups=N "
                "(gradients split into N fused groups) or leave both unset (one group)."
            )
        if not isinstance(num_groups, int) or num_groups < 0:
            raise ValueError(f"num_groups must be an integer >= 0, got {num_groups!r}")
        if gradient_predivide_factor != 1.0 and self.op != ReduceOp.Average:
            raise ValueError(
                f"gradient_predivide_factor={gradient_predivide_factor} needs op=Average, "
                f"got op={self.op.name}"
            )
        self.compression, self.sparse_as_dense = compression, sparse_as_dense
        self.predivide, self.num_groups = float(gradient_predivide_factor), num_groups
        self.process_set, self.prescale = process_set, float(prescale_factor)

    def _scales(self) -> tuple[ReduceOp, float, float]:
        if self.predivide != 1.0:  # Horovod: sum the pre-divided values, scale after
            n = (self.process_set or global_process_set).size()
            return ReduceOp.Sum, self.prescale / self.predivide, self.predivide / n
        return self.op, self.prescale, 1.0

    def reduce(self, grads: list[Any]) -> list[Any]:
        check_process_set(self.process_set, "DistributedGradientTape")
        if (self.process_set or global_process_set).size() == 1 and self.prescale == 1.0:
            return list(grads)
        grads = list(grads)
        if self.sparse_as_dense:
            grads = [
                tf.convert_to_tensor(g) if isinstance(g, tf.IndexedSlices) else g for g in grads
            ]
        op, pre, post = self._scales()
        out: list[Any] = list(grads)
        dense = [
            i for i, g in enumerate(grads) if g is not None and not isinstance(g, tf.IndexedSlices)
        ]
        for part in _split(dense, self.num_groups):
            reduced = grouped_allreduce(
                [grads[i] for i in part],
                compression=self.compression,
                op=op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=self.process_set,
            )
            for i, r in zip(part, reduced, strict=True):
                out[i] = r
        for i, g in enumerate(grads):
            if isinstance(g, tf.IndexedSlices):
                sparse_op = ReduceOp.Sum if op == ReduceOp.Sum else ReduceOp.Average
                reduced = allreduce(g, op=sparse_op, process_set=self.process_set)
                if pre * post != 1.0:
                    scaled = reduced.values * tf.cast(pre * post, reduced.values.dtype)
                    reduced = tf.IndexedSlices(scaled, reduced.indices, reduced.dense_shape)
                out[i] = reduced
        return out


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
            compression,
            sparse_as_dense,
            op,
            gradient_predivide_factor,
            num_groups,
            groups,
            process_set,
        )

    def gradient(self, target, sources, output_gradients=None, unconnected_gradients=None):
        kwargs = (
            {}
            if unconnected_gradients is None
            else {"unconnected_gradients": unconnected_gradients}
        )
        grads = self._tape.gradient(target, sources, output_gradients, **kwargs)
        flat = tf.nest.flatten(grads, expand_composites=False)
        return tf.nest.pack_sequence_as(grads, self._reducer.reduce(flat))

    def __enter__(self) -> DistributedGradientTape:
        self._tape.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._tape.__exit__(*exc)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tape, name)


def broadcast_variables(
    variables: Any,
    root_rank: int,
    process_set: ProcessSet = global_process_set,
    inplace: bool = False,
) -> Any:
    """Assign rank ``root_rank``'s value to every variable in ``variables`` on every rank
    (all broadcasts in flight at once)."""
    variables = list(variables)
    check_process_set(process_set, "broadcast_variables")
    _check_root(root_rank, process_set)
    if not variables:
        return tf.no_op() if not tf.executing_eagerly() else None

    def eager(*values):
        handles = [C.broadcast_async(to_torch(v), root_rank, None, process_set) for v in values]
        return [to_tf(C.synchronize(h)) for h in handles]

    values = [tf.convert_to_tensor(v) for v in variables]
    received = run_op(eager, values, [v.dtype for v in values], "RingBroadcastVariables")
    assigns = [v.assign(r) for v, r in zip(variables, received, strict=True)]
    return None if tf.executing_eagerly() else tf.group(*assigns)
