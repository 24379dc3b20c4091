"""``sparse_allreduce_async``: reduce a sparse gradient (an ``nn.Embedding(sparse=True)``)
as Horovod does — allgather every rank's indices and values, then coalesce."""

from __future__ import annotations

import torch

from .._ops import ReduceOp
from ..runtime.process_sets import ProcessSet, global_process_set
from ._async import allgather_async
from ._handles import _Group, _register, synchronize, synchronize_later

__all__ = ["sparse_allreduce_async"]


class SparseHandle(int):
    """The handle of a sparse allreduce. As Horovod's, calling it waits and returns the
    reduced sparse tensor; it is also an ordinary handle for ``poll``/``synchronize``."""

    def __call__(self) -> torch.Tensor:
        return synchronize(self)


def sparse_allreduce_async(
    tensor: torch.Tensor,
    name: str,
    op: ReduceOp | int = ReduceOp.Average,
    process_set: ProcessSet = global_process_set,
) -> SparseHandle:
    """Start the reduction of a sparse COO tensor; ``synchronize(handle)`` (or
    ``handle()``) returns a sparse tensor."""
    if not tensor.is_sparse:
        raise TypeError(
            "sparse_allreduce_async takes a sparse COO tensor; use allreduce_async for dense ones"
        )
    rop = ReduceOp(int(op))
    if rop not in (ReduceOp.Average, ReduceOp.Sum):
        raise ValueError(f"sparse allreduce supports Average and Sum, not {rop.name}")
    t = tensor.coalesce()
    indices = t.indices().t().contiguous()  # (nnz, ndim): rows gather along dim 0
    values = t.values().contiguous()
    n = process_set.size()
    parts = [
        synchronize_later(allgather_async(values, f"{name}.values", process_set)),
        synchronize_later(allgather_async(indices, f"{name}.indices", process_set)),
    ]

    def combine(results: list[torch.Tensor]) -> torch.Tensor:
        vals, idx = results
        if rop == ReduceOp.Average:
            vals = vals / n
        return torch.sparse_coo_tensor(idx.t(), vals, tensor.shape).coalesce()

    return SparseHandle(_register(_Group(name, parts, combine)))
