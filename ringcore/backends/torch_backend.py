"""Collectives through ``torch.distributed``: Gloo for CPU tensors, NCCL for CUDA ones.

With NCCL the process group is ``cpu:gloo,cuda:nccl``: torch sends each tensor to
the backend of its device. Without a CUDA backend, :func:`torch_backend` wraps the
group in :class:`~ringcore.backends.host_staged.HostStaged` so CUDA tensors still work.
Used only from the engine's thread; the ring algorithms are the libraries'.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _config as cfg
from .._ops import ReduceOp
from .host_staged import HostStaged
from .protocol import Backend

__all__ = ["TorchDistBackend", "torch_backend"]

# Element types Gloo and NCCL carry. Others (int16, the unsigned 16/32/64-bit types)
# travel as a same-size carried type when only bytes move (allgather, broadcast,
# alltoall), and widened to a carried type for a reduction.
_CARRIED = {
    torch.uint8,
    torch.int8,
    torch.int32,
    torch.int64,
    torch.float16,
    torch.bfloat16,
    torch.float32,
    torch.float64,
    torch.bool,
}
_SAME_SIZE = {1: torch.uint8, 2: torch.float16, 4: torch.int32, 8: torch.int64}
_WIDER = {torch.int16: torch.int32}
for _name, _wide in (("uint16", torch.int32), ("uint32", torch.int64)):
    if hasattr(torch, _name):
        _WIDER[getattr(torch, _name)] = _wide


def _as_carried(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, or a view of its bytes as a carried type of the same element size."""
    if t.dtype in _CARRIED:
        return t
    return t.view(_SAME_SIZE[t.element_size()])


def torch_backend() -> Backend:
    """The backend over the default ``torch.distributed`` group: CUDA tensors go through
    the group when it has a CUDA backend that is not Gloo (NCCL), else via host memory."""
    backend = TorchDistBackend()
    return backend if backend.cuda_native else HostStaged(backend)


def _backend_config(dist: Any) -> dict[str, str]:
    """``{"cpu": "gloo", "cuda": "nccl"}`` from the default group's configuration."""
    pairs = [p.split(":", 1) for p in str(dist.get_backend_config()).split(",") if ":" in p]
    return {device.strip(): name.strip() for device, name in pairs}


class TorchDistBackend:
    """Collectives through ``torch.distributed`` (the default process group and
    groups made with ``new_group``).

    ``name`` is "nccl" when CUDA tensors travel through NCCL, else the group's backend.
    A group adopted from the user with no CPU backend (``init_process_group("nccl")``)
    gets a Gloo side group for CPU tensors.
    """

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist
        config = _backend_config(dist)
        self.cuda_native = config.get("cuda", "gloo") not in ("gloo", "")
        self.name = "nccl" if config.get("cuda") == "nccl" else str(dist.get_backend())
        self._cpu_groups: dict[Any, Any] | None = None
        if "cpu" not in config:
            self._cpu_groups = {None: dist.new_group(backend="gloo", timeout=cfg.group_timeout())}
        self._ops = {
            ReduceOp.Sum: dist.ReduceOp.SUM,
            ReduceOp.Average: dist.ReduceOp.SUM,
            ReduceOp.Min: dist.ReduceOp.MIN,
            ReduceOp.Max: dist.ReduceOp.MAX,
            ReduceOp.Product: dist.ReduceOp.PRODUCT,
        }

    def _for(self, t: torch.Tensor, group: Any) -> Any:
        """The group to move ``t`` through (the Gloo side group for a CPU tensor when the
        adopted group is CUDA-only)."""
        if self._cpu_groups is None or t.is_cuda:
            return group
        return self._cpu_groups[group]

    def allreduce(self, t: torch.Tensor, op: ReduceOp, group: Any) -> None:
        if t.dtype in _CARRIED:
            self.dist.all_reduce(t, op=self._ops[op], group=self._for(t, group))
            return
        wide = t.to(_WIDER.get(t.dtype, torch.float64))
        self.dist.all_reduce(wide, op=self._ops[op], group=self._for(t, group))
        t.copy_(wide)

    def allgather(self, t: torch.Tensor, dims: list[int], group: Any) -> torch.Tensor:
        if t.dtype not in _CARRIED:
            return self.allgather(_as_carried(t), dims, group).view(t.dtype)
        group = self._for(t, group)
        longest = max(dims)
        x = (
            t
            if t.shape[0] == longest
            else torch.cat([t, t.new_zeros((longest - t.shape[0], *t.shape[1:]))])
        )
        parts = [torch.empty_like(x) for _ in dims]
        self.dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat([p[:d] for p, d in zip(parts, dims)])

    def broadcast(self, t: torch.Tensor, root: int, members: list[int], group: Any) -> None:
        self.dist.broadcast(_as_carried(t), src=root, group=self._for(t, group))

    def alltoall(
        self, t: torch.Tensor, send: list[int], recv: list[int], group: Any
    ) -> torch.Tensor:
        out = t.new_empty((sum(recv), *t.shape[1:]))
        self.dist.all_to_all_single(
            _as_carried(out),
            _as_carried(t),
            output_split_sizes=recv,
            input_split_sizes=send,
            group=self._for(t, group),
        )
        return out

    def barrier(self, group: Any) -> None:
        self.dist.barrier(group=group)

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any) -> None:
        group = self._for(send, group)
        ops = [
            self.dist.P2POp(self.dist.isend, send, peer, group),
            self.dist.P2POp(self.dist.irecv, recv, peer, group),
        ]
        for work in self.dist.batch_isend_irecv(ops):
            work.wait()

    def new_group(self, ranks: list[int], size: int) -> Any:
        if len(ranks) == size:
            return None
        group = self.dist.new_group(ranks, timeout=cfg.group_timeout())
        if self._cpu_groups is not None:
            self._cpu_groups[group] = self.dist.new_group(
                ranks, backend="gloo", timeout=cfg.group_timeout()
            )
        return group

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        box = [obj]
        self.dist.broadcast_object_list(box, src=root)
        return box[0]
