"""ringcore: the ring core shared by every ringtrain runner.

Lifecycle and topology live here (``init``, ``rank``, ``size``, ...). Collectives on
torch tensors are in :mod:`ringcore.torch` (``import ringcore.torch as hvd``) and are
also reachable here by name (``ringcore.allreduce``), importing torch on first use.
``import ringcore`` itself imports neither a framework nor pyspark, ray or petastorm.
"""

from __future__ import annotations

from typing import Any

from ._errors import (
    CollectiveMismatchError,
    CommandFailedError,
    HorovodInternalError,
    NotInitializedError,
    RendezvousError,
    RingError,
    RingInternalError,
    StackError,
    WorkerError,
)
from ._ops import Adasum, Average, Max, Min, Product, ReduceOp, Sum
from ._version import __version__ as __version__
from .rendezvous.environment import Rendezvous, read_environment, worker_env
from .rendezvous.store_server import start_store_server
from .rendezvous.topology import Topology, topology_from_hosts
from .runtime.capabilities import (
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
from .runtime.lifecycle import init, shutdown, start_timeline, stop_timeline
from .runtime.process_sets import (
    ProcessSet,
    add_process_set,
    global_process_set,
    remove_process_set,
)
from .runtime.state import (
    cross_rank,
    cross_size,
    is_homogeneous,
    is_initialized,
    local_rank,
    local_size,
    rank,
    size,
)

_TORCH_NAMES = (
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "join",
    "poll",
    "reducescatter",
    "reducescatter_async",
    "synchronize",
)

__all__ = [
    "Adasum",
    "Average",
    "CollectiveMismatchError",
    "HorovodInternalError",
    "Max",
    "Min",
    "NotInitializedError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "RendezvousError",
    "Rendezvous",
    "RingError",
    "RingInternalError",
    "StackError",
    "Sum",
    "Topology",
    "WorkerError",
    "CommandFailedError",
    "add_process_set",
    "remove_process_set",
    "start_timeline",
    "stop_timeline",
    "ccl_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "init",
    "is_homogeneous",
    "is_initialized",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rank",
    "read_environment",
    "rocm_built",
    "shutdown",
    "size",
    "start_store_server",
    "topology_from_hosts",
    "worker_env",
    *_TORCH_NAMES,
]


def __getattr__(name: str) -> Any:
    if name in _TORCH_NAMES:
        from . import torch as _torch_binding

        return getattr(_torch_binding, name)
    raise AttributeError(f"module 'ringcore' has no attribute {name!r}")
