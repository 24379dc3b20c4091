"""Horovod's TensorFlow API on ringcore: ``import ringcore.tensorflow as hvd``.

The same engine as :mod:`ringcore.torch` (TensorFlow tensors cross to it through
DLPack; see ``ringcore.tensorflow._bridge`` for the copies that remain). Every op
works in eager mode and inside ``tf.function``. Needs TensorFlow:
``pip install 'ringtrain[tensorflow]'``.
"""

from .._errors import CollectiveMismatchError, HorovodInternalError, RingError, RingInternalError
from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ..runtime.capabilities import (
    ccl_built,
    cuda_built,
    ddl_built,
    gloo_built,
    gloo_enabled,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rocm_built,
)
from ..runtime.lifecycle import init, shutdown, start_timeline, stop_timeline
from ..runtime.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from ..runtime.state import (
    cross_rank,
    cross_size,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)
from . import elastic
from ._bridge import tf as _tf  # noqa: F401  (raises the ImportError naming the extra)
from ._collectives import (
    allgather,
    allgather_object,
    allreduce,
    alltoall,
    barrier,
    broadcast,
    broadcast_object,
    grouped_allreduce,
    join,
    reducescatter,
)
from ._compression import Compression
from ._grouped import grouped_allgather, grouped_reducescatter
from ._optimizer import DistributedOptimizer
from ._rank_ops import local_rank_op, local_size_op, process_set_included_op, rank_op, size_op
from ._sync_batch_norm import SyncBatchNormalization
from ._training import (
    DistributedGradientTape,
    PartialDistributedGradientTape,
    broadcast_,
    broadcast_global_variables,
    broadcast_object_fn,
    broadcast_variables,
)

__all__ = [
    "Adasum",
    "Average",
    "CollectiveMismatchError",
    "Compression",
    "DistributedGradientTape",
    "DistributedOptimizer",
    "HorovodInternalError",
    "Max",
    "Min",
    "PartialDistributedGradientTape",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RingError",
    "RingInternalError",
    "Sum",
    "SyncBatchNormalization",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_global_variables",
    "broadcast_object",
    "broadcast_object_fn",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "elastic",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_reducescatter",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_rank_op",
    "local_size",
    "local_size_op",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "process_set_included_op",
    "rank",
    "rank_op",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "size_op",
    "start_timeline",
    "stop_timeline",
]
