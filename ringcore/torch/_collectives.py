"""Synchronous collectives on torch tensors over the global Gloo group.

Each function checks its arguments, runs ``torch.distributed`` underneath and wraps
a backend failure (a dead peer, a timeout) in :class:`RingInternalError`.
"""

from __future__ import annotations

import io
from typing import Any

import cloudpickle
import torch
import torch.distributed as dist

from .._errors import CollectiveMismatchError
from .._ops import ReduceOp, resolve_op
from .._process_sets import ProcessSet, check_process_set, global_process_set
from .._runtime import rank, size, translate_backend_error
from ._compression import Compression, Compressor

__all__ = [
    "allgather",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_object",
    "grouped_allreduce",
    "reducescatter",
]

_TORCH_OPS = {
    ReduceOp.Sum: dist.ReduceOp.SUM,
    ReduceOp.Average: dist.ReduceOp.SUM,
    ReduceOp.Min: dist.ReduceOp.MIN,
    ReduceOp.Max: dist.ReduceOp.MAX,
    ReduceOp.Product: dist.ReduceOp.PRODUCT,
}
_MAX_DIMS = 8


def _call(what: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except (RuntimeError, dist.DistError) as exc:
        raise translate_backend_error(exc, what) from exc


def _check_tensor(tensor: Any, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """Gloo moves no bool: carry it as uint8."""
    return tensor.to(torch.uint8) if tensor.dtype == torch.bool else tensor


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.mul_(factor)
    else:  # integers scale as Horovod's C++ core does: multiply, truncate
        tensor.copy_((tensor.to(torch.float64) * factor).trunc().to(tensor.dtype))


def allreduce_(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce ``tensor`` in place across all ranks and return it."""
    _check_tensor(tensor, "allreduce_")
    check_process_set(process_set)
    rop = resolve_op(average, op)
    if rop == ReduceOp.Adasum:
        raise NotImplementedError("op=Adasum arrives with the op engine; use Average for now.")
    if tensor.dtype == torch.bool and rop not in (ReduceOp.Min, ReduceOp.Max):
        raise TypeError(f"allreduce of a bool tensor supports op=Min or Max, not {rop.name}")
    wire = _wire(tensor)
    _scale(wire, prescale_factor)
    _call(f"allreduce of {name or 'a tensor'}", dist.all_reduce, wire, op=_TORCH_OPS[rop])
    if rop == ReduceOp.Average:
        if wire.dtype.is_floating_point or wire.dtype.is_complex:
            wire.div_(size())
        else:
            wire.copy_(torch.div(wire, size(), rounding_mode="trunc"))
    _scale(wire, postscale_factor)
    if wire is not tensor:
        tensor.copy_(wire)
    return tensor


def allreduce(
    tensor: torch.Tensor,
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return the reduction of ``tensor`` over all ranks (Average by default)."""
    _check_tensor(tensor, "allreduce")
    compressed, ctx = compression.compress(tensor.detach())
    out = compressed.clone() if compressed.data_ptr() == tensor.data_ptr() else compressed
    allreduce_(out, average, name, op, prescale_factor, postscale_factor, process_set)
    return compression.decompress(out, ctx)


def grouped_allreduce(
    tensors: list[torch.Tensor],
    average: bool | None = None,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int | None = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list[torch.Tensor]:
    """Reduce a list of tensors as one fused unit (one buffer per dtype)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        _check_tensor(t, "grouped_allreduce")
        by_dtype.setdefault(t.dtype, []).append(i)
    for idx in by_dtype.values():
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        reduced = allreduce(
            flat, average, name, compression, op, prescale_factor, postscale_factor, process_set
        )
        offset = 0
        for i in idx:
            n = tensors[i].numel()
            out[i] = reduced[offset : offset + n].view_as(tensors[i]).clone()
            offset += n
    return out  # type: ignore[return-value]


def _gather_shapes(tensor: torch.Tensor, what: str, name: str | None) -> list[tuple[int, ...]]:
    if tensor.dim() > _MAX_DIMS or tensor.dim() == 0:
        raise ValueError(
            f"{what} takes tensors of 1 to {_MAX_DIMS} dimensions, got shape {tuple(tensor.shape)}"
        )
    mine = torch.zeros(_MAX_DIMS + 1, dtype=torch.int64)
    mine[0] = tensor.dim()
    mine[1 : tensor.dim() + 1] = torch.tensor(tensor.shape, dtype=torch.int64)
    every = [torch.empty_like(mine) for _ in range(size())]
    _call(f"{what} of {name or 'a tensor'}", dist.all_gather, every, mine)
    shapes = [tuple(int(x) for x in v[1 : int(v[0]) + 1]) for v in every]
    if len({s[1:] for s in shapes}) != 1 or len({len(s) for s in shapes}) != 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in enumerate(shapes))
        raise CollectiveMismatchError(
            f"{what} of {name or 'a tensor'}: ranks may differ only in the first dimension, "
            f"but the shapes are {detail}. Make every dimension after the first agree."
        )
    return shapes


def allgather(
    tensor: torch.Tensor, name: str | None = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0; first dimensions may differ."""
    _check_tensor(tensor, "allgather")
    check_process_set(process_set)
    shapes = _gather_shapes(tensor, "allgather", name)
    longest = max(s[0] for s in shapes)
    wire = _wire(tensor.detach()).contiguous()
    if wire.shape[0] < longest:
        pad = wire.new_zeros((longest - wire.shape[0], *wire.shape[1:]))
        wire = torch.cat([wire, pad])
    parts = [torch.empty_like(wire) for _ in range(size())]
    _call(f"allgather of {name or 'a tensor'}", dist.all_gather, parts, wire)
    out = torch.cat([p[: s[0]] for p, s in zip(parts, shapes)])
    return out.to(tensor.dtype)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    _check_tensor(tensor, "broadcast_")
    check_process_set(process_set)
    if not 0 <= root_rank < size():
        raise ValueError(
            f"broadcast root_rank={root_rank} is not a rank of this job (size {size()})"
        )
    wire = _wire(tensor)
    _call(f"broadcast of {name or 'a tensor'}", dist.broadcast, wire, src=root_rank)
    if wire is not tensor:
        tensor.copy_(wire)
    return tensor


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return rank ``root_rank``'s ``tensor`` on every rank."""
    _check_tensor(tensor, "broadcast")
    return broadcast_(tensor.detach().clone(), root_rank, name, process_set)


def alltoall(
    tensor: torch.Tensor,
    splits: torch.Tensor | list[int] | None = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
):
    """Send ``splits[i]`` rows to rank i; receive from every rank in rank order.

    As Horovod: returns the received tensor, and also the received splits when
    ``splits`` was given.
    """
    _check_tensor(tensor, "alltoall")
    check_process_set(process_set)
    n = size()
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall without splits needs the first dimension ({rows}) to divide by the "
                f"number of ranks ({n}); pass splits= to send uneven parts."
            )
        send = torch.full((n,), rows // n, dtype=torch.int64)
    else:
        send = torch.as_tensor(splits, dtype=torch.int64).reshape(-1)
        if send.numel() != n or int(send.sum()) != rows or bool((send < 0).any()):
            raise ValueError(
                f"alltoall splits={send.tolist()} must have one non-negative entry per rank ({n}) "
                f"summing to the first dimension ({rows})."
            )
    recv = torch.empty_like(send)
    _call(f"alltoall splits of {name or 'a tensor'}", dist.all_to_all_single, recv, send)
    wire = _wire(tensor.detach()).contiguous()
    out = wire.new_empty((int(recv.sum()), *wire.shape[1:]))
    _call(
        f"alltoall of {name or 'a tensor'}",
        dist.all_to_all_single,
        out,
        wire,
        output_split_sizes=recv.tolist(),
        input_split_sizes=send.tolist(),
    )
    out = out.to(tensor.dtype)
    return out if splits is None else (out, recv)


def reducescatter(
    tensor: torch.Tensor,
    name: str | None = None,
    compression: type[Compressor] = Compression.none,
    op: ReduceOp | int = ReduceOp.Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce across ranks, then keep this rank's slice of dim 0 (the first
    ``rows % size`` ranks get one row more, as Horovod splits)."""
    _check_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    reduced = allreduce(
        tensor, None, name, compression, op, prescale_factor, postscale_factor, process_set
    )
    n, me = size(), rank()
    rows = tensor.shape[0]
    base, extra = divmod(rows, n)
    start = me * base + min(me, extra)
    return reduced[start : start + base + (1 if me < extra else 0)].clone()


def barrier(process_set: ProcessSet = global_process_set) -> None:
    check_process_set(process_set)
    _call("barrier", dist.barrier)


def broadcast_object(
    obj: Any = None,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Return rank ``root_rank``'s ``obj`` (pickled with cloudpickle) on every rank."""
    payload = cloudpickle.dumps(obj) if rank() == root_rank else b""
    length = broadcast_(
        torch.tensor([len(payload)], dtype=torch.int64), root_rank, name, process_set
    )
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(int(length), dtype=torch.uint8)
    )
    broadcast_(buf, root_rank, name, process_set)
    if rank() == root_rank:
        return obj
    return cloudpickle.load(io.BytesIO(buf.numpy().tobytes()))


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """Return the list of every rank's ``obj``, ordered by rank."""
    payload = cloudpickle.dumps(obj)
    mine = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    lengths = allgather(torch.tensor([len(payload)], dtype=torch.int64), name, process_set)
    data = allgather(mine, name, process_set).numpy().tobytes()
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(cloudpickle.loads(data[offset : offset + n]))
        offset += n
    return out
