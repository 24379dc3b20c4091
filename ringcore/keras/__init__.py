"""Horovod's Keras API on ringcore, for Keras 3 on the TensorFlow backend:
``import ringcore.keras as hvd``.

``DistributedOptimizer(optimizer)`` goes into ``model.compile`` as is; the callbacks
broadcast the initial state, average metrics and schedule the learning rate;
``load_model`` restores a model saved with a wrapped optimizer and wraps it again.
Needs TensorFlow: ``pip install 'ringtrain[tensorflow]'``.
"""

from __future__ import annotations

from typing import Any

# First, so that a missing TensorFlow raises the ImportError that names the extra.
from ..tensorflow._bridge import tf as _tf  # noqa: F401

# isort: split

import keras

from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..runtime.capabilities import gloo_built, gloo_enabled, mpi_built, mpi_enabled, nccl_built
from ..runtime.lifecycle import init, shutdown
from ..runtime.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from ..runtime.state import (
    cross_rank,
    cross_size,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from ..tensorflow import (
    allgather,
    allgather_object,
    allreduce,
    barrier,
    broadcast,
    broadcast_object,
    broadcast_variables,
    grouped_allreduce,
    join,
    reducescatter,
)
from ..tensorflow._compression import Compression
from ..tensorflow._keras_optimizer import (
    DistributedOptimizer,
    PartialDistributedOptimizer,
    wrap_in_place,
)
from ..tensorflow._training import ReductionOptions
from . import callbacks, elastic
from ._callbacks import (
    BestModelCheckpoint,
    BroadcastGlobalVariablesCallback,
    LearningRateScheduleCallback,
    LearningRateWarmupCallback,
    MetricAverageCallback,
    model_variables,
)

__all__ = [
    "Adasum",
    "Average",
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "Compression",
    "DistributedOptimizer",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "Max",
    "MetricAverageCallback",
    "Min",
    "PartialDistributedOptimizer",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "barrier",
    "broadcast",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_variables",
    "callbacks",
    "cross_rank",
    "cross_size",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "init",
    "is_initialized",
    "join",
    "load_model",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "shutdown",
    "size",
]


def broadcast_global_variables(root_rank: int, model: Any = None) -> None:
    """Give every rank rank ``root_rank``'s weights and optimizer state of ``model``.

    Keras 3 has no collection of global variables (Horovod's TF1 notion), so the
    model whose variables to broadcast must be named; in ``model.fit`` use
    ``BroadcastGlobalVariablesCallback(root_rank)`` instead."""
    if model is None:
        raise ValueError(
            "broadcast_global_variables needs model=: Keras 3 keeps no global variable "
            "collection. Call broadcast_global_variables(0, model=model) or pass "
            "BroadcastGlobalVariablesCallback(0) to model.fit."
        )
    broadcast_variables(model_variables(model), root_rank)


def load_model(
    filepath: str,
    custom_optimizers: list[type] | None = None,
    custom_objects: dict[str, Any] | None = None,
    compression: Any = Compression.none,
    **distributed: Any,
) -> Any:
    """``keras.models.load_model`` of a model saved with a ``DistributedOptimizer``;
    its optimizer (state kept) is made distributed again with ``compression`` and the
    other ``DistributedOptimizer`` keyword arguments given here."""
    objects = dict(custom_objects or {})
    for cls in custom_optimizers or []:
        objects[cls.__name__] = cls
    model = keras.models.load_model(filepath, custom_objects=objects or None)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None:
        average = bool(distributed.pop("average_aggregated_gradients", False))
        options = ReductionOptions(compression=compression, **distributed)
        wrap_in_place(optimizer, options, average_aggregated_gradients=average)
    return model
