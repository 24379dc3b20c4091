"""``ringcore.tensorflow.DistributedOptimizer``: a Keras optimizer goes to
``ringcore.keras.DistributedOptimizer``; a ``tf.compat.v1.train.Optimizer`` is
wrapped so that ``compute_gradients`` returns gradients averaged over the ranks."""

from __future__ import annotations

from typing import Any

import keras

from .._ops import ReduceOp
from ..runtime.process_sets import ProcessSet, global_process_set
from ._bridge import tf
from ._compression import Compression
from ._keras_optimizer import DistributedOptimizer as keras_distributed
from ._training import GradientReducer, ReductionOptions

__all__ = ["DistributedOptimizer"]


class _V1DistributedOptimizer(tf.compat.v1.train.Optimizer):
    def __init__(
        self, optimizer: Any, reducer: GradientReducer, name: str | None, use_locking: bool
    ):
        super().__init__(
            name=name or f"Distributed{type(optimizer).__name__}", use_locking=use_locking
        )
        self._optimizer, self._reducer = optimizer, reducer

    def compute_gradients(self, *args: Any, **kwargs: Any) -> list[tuple[Any, Any]]:
        pairs = self._optimizer.compute_gradients(*args, **kwargs)
        grads = self._reducer.reduce([g for g, _ in pairs])
        return list(zip(grads, [v for _, v in pairs], strict=True))

    def apply_gradients(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.apply_gradients(*args, **kwargs)

    def get_slot(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot(*args, **kwargs)

    def get_slot_names(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.get_slot_names(*args, **kwargs)

    def variables(self, *args: Any, **kwargs: Any) -> Any:
        return self._optimizer.variables(*args, **kwargs)


def DistributedOptimizer(
    optimizer: Any,
    name: str | None = None,
    use_locking: bool = False,
    device_dense: str = "",
    device_sparse: str = "",
    compression: Any = Compression.none,
    sparse_as_dense: bool = False,
    backward_passes_per_step: int = 1,
    op: Any = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    average_aggregated_gradients: bool = False,
    num_groups: int = 0,
    groups: Any = None,
    process_set: ProcessSet = global_process_set,
    scale_local_gradients: bool = True,
) -> Any:
    """Horovod's ``hvd.DistributedOptimizer`` for TensorFlow: gradients are averaged
    over the ranks before they are applied."""
    if isinstance(optimizer, keras.optimizers.Optimizer):
        return keras_distributed(
            optimizer,
            name=name,
            compression=compression,
            sparse_as_dense=sparse_as_dense,
            gradient_predivide_factor=gradient_predivide_factor,
            op=op,
            backward_passes_per_step=backward_passes_per_step,
            average_aggregated_gradients=average_aggregated_gradients,
            num_groups=num_groups,
            groups=groups,
            process_set=process_set,
            scale_local_gradients=scale_local_gradients,
        )
    if isinstance(optimizer, tf.compat.v1.train.Optimizer):
        if backward_passes_per_step != 1:
            raise NotImplementedError(
                "backward_passes_per_step > 1 is supported for Keras optimizers only; "
                f"got {backward_passes_per_step} with {type(optimizer).__name__}"
            )
        reducer = GradientReducer(
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
        return _V1DistributedOptimizer(optimizer, reducer, name, use_locking)
    raise TypeError(
        "DistributedOptimizer wraps a keras.optimizers.Optimizer or a "
        f"tf.compat.v1.train.Optimizer, got {type(optimizer).__name__}"
    )
