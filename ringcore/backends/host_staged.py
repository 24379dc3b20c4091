"""CUDA tensors over a CPU-only backend (Gloo without NCCL, MPI), through host memory."""

from __future__ import annotations

from typing import Any

import torch

from .._ops import ReduceOp
from .protocol import Backend

__all__ = ["HostStaged"]


class HostStaged:
    """A CPU-only backend (Gloo without NCCL, MPI) that also takes CUDA tensors.

    Each collective on a CUDA tensor copies it to host memory, runs the inner
    backend there, and copies the result back onto the tensor's device: one
    device-to-host and one host-to-device copy per op (a fused allreduce is one op),
    and the copies synchronize the engine's stream with the host. CPU tensors pass
    through untouched.
    """

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.name = inner.name

    def allreduce(self, t: torch.Tensor, op: ReduceOp, group: Any) -> None:
        if not t.is_cuda:
            return self.inner.allreduce(t, op, group)
        host = t.cpu()
        self.inner.allreduce(host, op, group)
        t.copy_(host)
        return None

    def allgather(self, t: torch.Tensor, dims: list[int], group: Any) -> torch.Tensor:
        if not t.is_cuda:
            return self.inner.allgather(t, dims, group)
        return self.inner.allgather(t.cpu(), dims, group).to(t.device)

    def broadcast(self, t: torch.Tensor, root: int, members: list[int], group: Any) -> None:
        if not t.is_cuda:
            return self.inner.broadcast(t, root, members, group)
        host = t.cpu()
        self.inner.broadcast(host, root, members, group)
        t.copy_(host)
        return None

    def alltoall(
        self, t: torch.Tensor, send: list[int], recv: list[int], group: Any
    ) -> torch.Tensor:
        if not t.is_cuda:
            return self.inner.alltoall(t, send, recv, group)
        return self.inner.alltoall(t.cpu(), send, recv, group).to(t.device)

    def barrier(self, group: Any) -> None:
        self.inner.barrier(group)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any) -> None:
        if not (send.is_cuda or recv.is_cuda):
            return self.inner.exchange(send, recv, peer, group)
        host = recv.cpu()
        self.inner.exchange(send.cpu(), host, peer, group)
        recv.copy_(host)
        return None

    def new_group(self, ranks: list[int], size: int) -> Any:
        return self.inner.new_group(ranks, size)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast_object(obj, root)
