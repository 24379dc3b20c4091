"""Horovod's TensorFlow API on ringcore: ``import ringcore.tensorflow as hvd``.

The same engine as :mod:`ringcore.torch` (TensorFlow tensors cross to it through
DLPack; see ``ringcore.tensorflow._bridge`` for the copies that remain). Every op
works in eager mode and inside ``tf.function``. Needs TensorFlow:
``pip install 'ringtrain[tensorflow]'``.
"""

from .._capabilities import (
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
from .._errors import CollectiveMismatchError, HorovodInternalError, RingError, RingInternalError
from .._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from .._process_sets import ProcessSet, add_process_set, global_process_set, remove_process_set
from .._runtime import (
    cross_rank,
    cross_size,
    init,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)
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
from ._optimizer import DistributedOptimizer
from ._training import DistributedGradientTape, broadcast_variables

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
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RingError",
    "RingInternalError",
    "Sum",
    "add_process_set",
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "broadcast_variables",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allreduce",
    "init",
    "is_homogeneous",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "reducescatter",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "start_timeline",
    "stop_timeline",
]
