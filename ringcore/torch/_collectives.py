"""Collectives on torch tensors, as Horovod's ``horovod.torch`` offers them: the blocking
forms (differentiable where Horovod's are: ``_autograd``), ``barrier``, ``join`` and
objects. Each submits its op (``_async``) and waits for it (``_handles``).
"""

from __future__ import annotations

import io
from typing import Any

import cloudpickle
import torch

from .._ops import OpKind, ReduceOp
from ..engine.handle import Handle
from ..engine.protocol import Request
from ..runtime.process_sets import ProcessSet, check_process_set, global_process_set
from ..runtime.state import engine, rank
from . import _autograd
from ._async import (
    _allreduce_start,
    _check_tensor,
    allgather_async,
    alltoall_async,
    broadcast_async,
    broadcast_async_,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter_async,
    reducescatter_async,
)
from ._compression import Compression, Compressor
from ._handles import _register, synchronize

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
    "grouped_allgather",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_reducescatter",
    "join",
    "reducescatter",
]


def allreduce(
    tensor,
    average=None,
    name=None,
    compression: type[Compressor] = Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
):
    """The reduction of ``tensor`` over the ranks of ``process_set``, as a new tensor.

    ``op``: Average (default), Sum, Min, Max, Product or Adasum (``average=`` is the
    deprecated spelling); ``compression`` compresses it for the wire (e.g.
    ``Compression.fp16``); ``prescale_factor`` / ``postscale_factor`` scale it before
    and after. Differentiable: the gradient is the allreduce of the gradient.
    Blocks until every rank of the set has submitted ``name``."""
    _check_tensor(tensor, "allreduce")
    if _autograd.differentiable(tensor) and compression is Compression.none:
        return _autograd.Allreduce.apply(
            tensor, average, name, op, prescale_factor, postscale_factor, process_set
        )
    compressed, ctx = compression.compress(tensor.detach())
    out = synchronize(
        _allreduce_start(
            compressed,
            average,
            name,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            inplace=False,
            now=True,
        )
    )
    return compression.decompress(out, ctx)


def allreduce_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
):
    """Reduce ``tensor`` in place over the ranks of ``process_set`` and return it.

    Arguments as :func:`allreduce_async_`; blocks until the reduction is done."""
    return synchronize(
        _allreduce_start(
            tensor,
            average,
            name,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
            inplace=True,
            now=True,
        )
    )


def grouped_allreduce(
    tensors,
    average=None,
    name=None,
    compression: type[Compressor] = Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
):
    """Reduce a list of tensors as one fused unit; returns a list of new tensors.

    Arguments as :func:`allreduce` (one ``op``, ``compression`` and scale factors for
    every tensor). Differentiable. Blocks until the whole group is reduced."""
    if _autograd.any_differentiable(tensors) and compression is Compression.none:
        return list(
            _autograd.GroupedAllreduce.apply(
                average, name, op, prescale_factor, postscale_factor, process_set, *tensors
            )
        )
    packed = [compression.compress(t.detach()) for t in tensors]
    outs = synchronize(
        grouped_allreduce_async(
            [p[0] for p in packed],
            average,
            name,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


def grouped_allreduce_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
):
    """Reduce a list of tensors in place as one fused unit; returns ``tensors``.

    Arguments as :func:`grouped_allreduce_async_`; blocks until the group is done."""
    return synchronize(
        grouped_allreduce_async_(
            tensors, average, name, op, prescale_factor, postscale_factor, process_set
        )
    )


def allgather(tensor, name=None, process_set: ProcessSet = global_process_set):
    """Every rank's ``tensor`` of ``process_set``, concatenated along dimension 0.

    The first dimension may differ between ranks; the others must agree.
    Differentiable (the gradient: this rank's rows of the averaged gradient).
    Returns a new tensor; blocks until every rank has submitted ``name``."""
    if _autograd.differentiable(tensor):
        return _autograd.Allgather.apply(tensor, name, process_set)
    return synchronize(allgather_async(tensor, name, process_set))


def grouped_allgather(tensors, name=None, process_set: ProcessSet = global_process_set):
    """Allgather each tensor of ``tensors``; returns the list of gathered tensors.

    As :func:`allgather` for each (first dimensions may differ per rank).
    Differentiable."""
    if _autograd.any_differentiable(tensors):
        return list(_autograd.GroupedAllgather.apply(name, process_set, *tensors))
    return synchronize(grouped_allgather_async(tensors, name, process_set))


def broadcast_(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set):
    """Overwrite ``tensor`` with rank ``root_rank``'s ``tensor``, in place; returns it.

    Arguments as :func:`broadcast_async_`; blocks until the broadcast is done."""
    return synchronize(broadcast_async_(tensor, root_rank, name, process_set))


def broadcast(tensor, root_rank, name=None, process_set: ProcessSet = global_process_set):
    """Rank ``root_rank``'s ``tensor``, on every rank of ``process_set``, as a new tensor.

    ``root_rank`` is a global rank of the set; shape and dtype must agree on every
    rank. Differentiable (the gradient: the averaged gradient on the root, zeros
    elsewhere). Blocks until done."""
    if _autograd.differentiable(tensor):
        return _autograd.Broadcast.apply(tensor, root_rank, name, process_set)
    return synchronize(broadcast_async(tensor, root_rank, name, process_set))


def alltoall(tensor, splits=None, name=None, process_set: ProcessSet = global_process_set):
    """Send ``splits[i]`` rows of ``tensor`` to the i-th rank of ``process_set``.

    ``splits``: one entry per rank summing to ``tensor.shape[0]`` (None: even parts).
    As Horovod, returns the received tensor (rows from every rank, in rank order),
    and also the received splits as an int64 tensor when ``splits`` was given.
    Differentiable. Blocks until done."""
    if _autograd.differentiable(tensor):
        out, received = _autograd.Alltoall.apply(tensor, splits, name, process_set)
        return out if splits is None else (out, received)
    return synchronize(alltoall_async(tensor, splits, name, process_set))


def reducescatter(
    tensor,
    name=None,
    compression: type[Compressor] = Compression.none,
    op=ReduceOp.Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """The reduction of ``tensor`` over ``process_set``, this rank's slice of dimension 0.

    ``op``: Average (default), Sum, Min, Max or Product; ``compression`` for the wire;
    the first ``rows % size`` ranks get one row more, as Horovod splits.
    Differentiable (the gradient is an allgather). Returns a new tensor."""
    if _autograd.differentiable(tensor) and compression is Compression.none:
        return _autograd.Reducescatter.apply(
            tensor, name, op, process_set, prescale_factor, postscale_factor
        )
    compressed, ctx = compression.compress(tensor.detach())
    out = synchronize(
        reducescatter_async(compressed, name, op, process_set, prescale_factor, postscale_factor)
    )
    return compression.decompress(out, ctx)


def grouped_reducescatter(
    tensors,
    name=None,
    compression: type[Compressor] = Compression.none,
    op=ReduceOp.Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reducescatter each tensor of ``tensors``; returns the list of this rank's slices.

    Arguments as :func:`reducescatter` (one ``op``, ``compression`` and scale
    factors for every tensor). Differentiable."""
    if _autograd.any_differentiable(tensors) and compression is Compression.none:
        return list(
            _autograd.GroupedReducescatter.apply(
                name, op, process_set, prescale_factor, postscale_factor, *tensors
            )
        )
    packed = [compression.compress(t.detach()) for t in tensors]
    outs = synchronize(
        grouped_reducescatter_async(
            [p[0] for p in packed], name, op, process_set, prescale_factor, postscale_factor
        )
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed)]


# -- barrier, join, objects -------------------------------------------------------------


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Block until every rank of ``process_set`` has called ``barrier``; returns None."""
    ps = check_process_set(process_set, "barrier")
    eng = engine()
    name = eng.auto_name(OpKind.BARRIER)
    h = eng.submit(Handle(name, OpKind.BARRIER), Request(name, OpKind.BARRIER, process_set=ps))
    synchronize(_register(h))


def join(device: int = -1) -> int:
    """Declare this rank out of data: until every rank has joined, the others'
    allreduces go on with this rank contributing zeros (the neutral element for
    Min/Max/Product). Returns the last rank to join."""
    return synchronize(_register(engine().join()))


def broadcast_object(
    obj: Any = None,
    root_rank: int = 0,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Rank ``root_rank``'s ``obj`` (pickled with cloudpickle) on every rank."""
    name = name or engine().auto_name("broadcast_object")
    payload = cloudpickle.dumps(obj) if rank() == root_rank else b""
    length = broadcast_(
        torch.tensor([len(payload)], dtype=torch.int64), root_rank, f"{name}.len", process_set
    )
    buf = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(int(length), dtype=torch.uint8)
    )
    broadcast_(buf, root_rank, f"{name}.data", process_set)
    if rank() == root_rank:
        return obj
    return cloudpickle.load(io.BytesIO(buf.numpy().tobytes()))


def allgather_object(
    obj: Any, name: str | None = None, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """The list of every rank's ``obj``, ordered by rank."""
    name = name or engine().auto_name("allgather_object")
    payload = cloudpickle.dumps(obj)
    mine = (
        torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        if payload
        else torch.empty(0, dtype=torch.uint8)
    )
    lengths = allgather(torch.tensor([len(payload)], dtype=torch.int64), f"{name}.len", process_set)
    data = allgather(mine, f"{name}.data", process_set).numpy().tobytes()
    out, offset = [], 0
    for n in lengths.tolist():
        out.append(cloudpickle.loads(data[offset : offset + n]))
        offset += n
    return out
