"""Submitting ops on torch tensors: the ``*_async`` forms of Horovod's ``horovod.torch``.

Every op is submitted to the engine by name and returns a handle (``_handles``). Unnamed
ops get deterministic names (``allreduce.noname.<n>``), so ranks that call ops in the
same order agree on them. The blocking (and differentiable) forms are in
``_collectives``.
"""

from __future__ import annotations

from typing import Any

import torch

from .._ops import OpKind, ReduceOp, resolve_op
from ..engine.handle import Handle, InputHandle, dtype_name
from ..engine.protocol import Request
from ..engine.reduction import is_power_of_two
from ..runtime.process_sets import ProcessSet, check_process_set, global_process_set
from ..runtime.state import engine, size
from ._handles import _Group, _register, synchronize_later

__all__ = [
    "allgather_async",
    "allreduce_async",
    "allreduce_async_",
    "alltoall_async",
    "broadcast_async",
    "broadcast_async_",
    "grouped_allgather_async",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter_async",
    "reducescatter_async",
]

_MAX_DIMS = 8
# the kinds, bound once (a member read off OpKind costs ~60 ns: see OpKind)
_ALLREDUCE, _ALLGATHER, _BROADCAST = OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.BROADCAST
_ALLTOALL, _REDUCESCATTER = OpKind.ALLTOALL, OpKind.REDUCESCATTER


def _check_tensor(tensor: Any, what: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{what} takes a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() > _MAX_DIMS:
        raise ValueError(
            f"{what} takes tensors of at most {_MAX_DIMS} dimensions, got shape {tuple(tensor.shape)}"
        )


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """The buffer the backend moves (Gloo carries no bool: uint8 instead). The engine
    runs under ``torch.no_grad()``, so a contiguous tensor is used as it is: every torch
    call here releases and retakes the GIL, which the engine's threads then hold."""
    if tensor.dtype == torch.bool:
        return tensor.detach().to(torch.uint8)
    return tensor if tensor.is_contiguous() else tensor.detach().contiguous()


def _request(kind: OpKind, name: str, tensor: torch.Tensor, ps: int, **extra: Any) -> Request:
    """The request for an op on ``tensor``; ``extra``: the kind's fields (op, root, ...)."""
    return Request(
        name,
        kind,
        dtype=dtype_name(tensor.dtype),
        shape=tuple(tensor.shape),
        process_set=ps,
        device=tensor.device.type,
        **extra,
    )


def _back_to(dtype: torch.dtype):
    return lambda t: t if t.dtype == dtype else t.to(dtype)


def _input_handle(name: str, tensor: torch.Tensor) -> Handle:
    """The handle of an allreduce into a new tensor: on the CPU the engine thread makes
    the copy (see ``InputHandle``); a CUDA tensor is copied here, on the caller's
    stream, so that the result belongs to that stream."""
    if tensor.is_cuda:
        buf = _wire(tensor).clone()
        return Handle(name, _ALLREDUCE, tensor=buf, finish=_back_to(tensor.dtype))
    return InputHandle(name, _ALLREDUCE, tensor=_wire(tensor), finish=_back_to(tensor.dtype))


# -- allreduce ----------------------------------------------------------------------


#: requests already made, by everything they hold: a request is immutable, and a
#: training loop submits the same few hundred every step (cleared when it grows past
#: _REQUESTS_MAX: names made fresh for every call never repeat)
_requests: dict[tuple, Request] = {}
_REQUESTS_MAX = 4096


def _allreduce_req(
    tensor, name, op, prescale_factor, postscale_factor, process_set, what, group=None
):
    if (
        group is None
        and op != ReduceOp.Adasum  # its check depends on the job's size
        and type(tensor) is torch.Tensor
        and tensor.dim() <= _MAX_DIMS
        and (process_set is None or type(process_set) is ProcessSet)
    ):
        key = (
            name,
            tensor.dtype,
            tensor.shape,
            tensor.device.type,
            op,
            prescale_factor,
            postscale_factor,
            process_set,
        )
        req = _requests.get(key)
        if req is not None and check_process_set(process_set, what) == req.process_set:
            return req
        req = _allreduce_req_made(
            tensor, name, op, prescale_factor, postscale_factor, process_set, what
        )
        if len(_requests) >= _REQUESTS_MAX:
            _requests.clear()
        _requests[key] = req
        return req
    return _allreduce_req_made(
        tensor, name, op, prescale_factor, postscale_factor, process_set, what, group
    )


def _allreduce_req_made(
    tensor, name, op, prescale_factor, postscale_factor, process_set, what, group=None
):
    _check_tensor(tensor, what)
    ps = check_process_set(process_set, what)
    if op == ReduceOp.Adasum:
        n = process_set.size() if process_set is not None else size()
        if not is_power_of_two(n):
            raise ValueError(
                f"op=Adasum needs a power-of-two number of ranks, got {n}; use op=Average"
            )
        if not tensor.dtype.is_floating_point:
            raise TypeError(f"op=Adasum needs a floating-point tensor, got {tensor.dtype}")
    if tensor.dtype == torch.bool and op not in (ReduceOp.Min, ReduceOp.Max):
        raise TypeError(f"allreduce of a bool tensor supports op=Min or Max, not {op.name}")
    extra: dict[str, Any] = {
        "op": int(op),
        "prescale": float(prescale_factor),
        "postscale": float(postscale_factor),
    }
    if group is not None:
        extra.update(group=group[0], group_size=group[1])
    return _request(_ALLREDUCE, name, tensor, ps, **extra)


def allreduce_async_(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start an in-place allreduce of ``tensor`` over the ranks of ``process_set``.

    ``op`` is the reduction (Average by default; ``average=`` is Horovod's deprecated
    spelling of it), scaled by ``prescale_factor`` before and ``postscale_factor``
    after. ``name`` must be the same on every rank (unnamed ops are numbered in call
    order). Returns a handle; ``synchronize(handle)`` returns ``tensor``, reduced."""
    return _allreduce_start(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set,
        inplace=True, now=False,
    )  # fmt: skip


def _allreduce_start(
    tensor,
    average,
    name,
    op,
    prescale_factor,
    postscale_factor,
    process_set,
    *,
    inplace: bool,
    now: bool,
    held: bool = False,
) -> int:
    """``allreduce_async(_)``; ``now``: the caller synchronizes next (a blocking form),
    so the request leaves from this thread at once (``Engine.submit_many``); ``held``:
    the caller waits for it before anything else (a gradient the optimizer's step waits
    for), so on a one-host job it stays queued for the fast lane (``Handle.held``)."""
    what = "allreduce_async_" if inplace else "allreduce_async"
    rop = resolve_op(average, op)
    eng = engine()
    name = name or eng.auto_name(_ALLREDUCE)
    req = _allreduce_req(tensor, name, rop, prescale_factor, postscale_factor, process_set, what)
    if inplace:
        handle = Handle(name, _ALLREDUCE, tensor=_wire(tensor), into=tensor, held=held)
    else:
        handle = _input_handle(name, tensor)
    return _register(eng.submit(handle, req, now=now))


def allreduce_async(
    tensor,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start an allreduce of ``tensor`` into a new tensor; ``tensor`` is left as it is.

    Arguments as :func:`allreduce_async_`. Returns a handle; ``synchronize(handle)``
    returns the reduced tensor (same shape and dtype as ``tensor``). As in Horovod,
    ``tensor`` is read when the op runs: do not modify it until ``synchronize``."""
    return _allreduce_start(
        tensor, average, name, op, prescale_factor, postscale_factor, process_set,
        inplace=False, now=False,
    )  # fmt: skip


def _grouped_allreduce_async(
    tensors, average, name, op, prescale_factor, postscale_factor, process_set, inplace
):
    rop = resolve_op(average, op)
    eng = engine()
    if not isinstance(tensors, list | tuple) or not tensors:
        raise TypeError("grouped_allreduce takes a non-empty list of tensors")
    base = name or eng.auto_name("grouped_allreduce")
    gid = f"{base}#group"
    items, handles = [], []
    for i, t in enumerate(tensors):
        n = f"{base}.{i}"
        req = _allreduce_req(
            t,
            n,
            rop,
            prescale_factor,
            postscale_factor,
            process_set,
            "grouped_allreduce",
            group=(gid, len(tensors)),
        )
        h = Handle(n, _ALLREDUCE, tensor=_wire(t), into=t) if inplace else _input_handle(n, t)
        items.append((h, req))
        handles.append(h)
    eng.submit_many(items)
    return _register(_Group(base, handles))


def grouped_allreduce_async(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start allreduces of a list of tensors that run as one fused unit.

    Every tensor of ``tensors`` is reduced with the same ``op`` and scale factors (see
    :func:`allreduce_async`), and they are negotiated and fused together: the group
    runs when every rank has submitted all of it. Returns one handle;
    ``synchronize(handle)`` returns the list of reduced tensors (new tensors)."""
    return _grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set, False
    )


def grouped_allreduce_async_(
    tensors,
    average=None,
    name=None,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
) -> int:
    """Start in-place allreduces of a list of tensors that run as one fused unit.

    As :func:`grouped_allreduce_async`, but each tensor is reduced in place;
    ``synchronize(handle)`` returns the list ``tensors``, reduced."""
    return _grouped_allreduce_async(
        tensors, average, name, op, prescale_factor, postscale_factor, process_set, True
    )


# -- allgather, broadcast, alltoall, reducescatter ------------------------------------


def allgather_async(tensor, name=None, process_set: ProcessSet = global_process_set) -> int:
    """Start an allgather: every rank's ``tensor`` concatenated along dimension 0.

    The first dimension may differ between ranks; every other dimension, and the
    dtype, must agree. ``tensor`` needs at least one dimension. Returns a handle;
    ``synchronize(handle)`` returns the concatenation, in rank order of
    ``process_set``."""
    _check_tensor(tensor, "allgather")
    if tensor.dim() == 0:
        raise ValueError(
            "allgather needs a tensor with at least one dimension; use tensor.reshape(1)"
        )
    ps = check_process_set(process_set, "allgather")
    eng = engine()
    name = name or eng.auto_name(_ALLGATHER)
    req = _request(_ALLGATHER, name, tensor, ps)
    return _register(
        eng.submit(
            Handle(name, _ALLGATHER, tensor=_wire(tensor), finish=_back_to(tensor.dtype)), req
        )
    )


def grouped_allgather_async(
    tensors, name=None, process_set: ProcessSet = global_process_set
) -> int:
    """Start an allgather of each tensor of ``tensors`` (named ``<name>.<i>``).

    Returns one handle; ``synchronize(handle)`` returns the list of gathered tensors,
    as :func:`allgather_async` gives each."""
    eng = engine()
    base = name or eng.auto_name("grouped_allgather")
    hs = [
        synchronize_later(allgather_async(t, f"{base}.{i}", process_set))
        for i, t in enumerate(tensors)
    ]
    return _register(_Group(base, hs))


def broadcast_async_(
    tensor, root_rank, name=None, process_set: ProcessSet = global_process_set
) -> int:
    """Start an in-place broadcast: ``tensor`` becomes rank ``root_rank``'s ``tensor``.

    ``root_rank`` is a global rank and must be a member of ``process_set``; shape and
    dtype must agree on every rank. Returns a handle; ``synchronize(handle)`` returns
    ``tensor``, overwritten with the root's values (the root's is unchanged)."""
    _check_tensor(tensor, "broadcast")
    ps = check_process_set(process_set, "broadcast")
    members = (
        process_set.ranks
        if process_set is not None and process_set.ranks is not None
        else range(size())
    )
    if root_rank not in members:
        raise ValueError(
            f"broadcast root_rank={root_rank} is not a rank of {process_set!r} (ranks {list(members)})"
        )
    eng = engine()
    name = name or eng.auto_name(_BROADCAST)
    wire = _wire(tensor)

    req = _request(_BROADCAST, name, tensor, ps, root=int(root_rank))
    return _register(eng.submit(Handle(name, _BROADCAST, tensor=wire, into=tensor), req))


def broadcast_async(
    tensor, root_rank, name=None, process_set: ProcessSet = global_process_set
) -> int:
    """Start a broadcast of rank ``root_rank``'s ``tensor`` into a new tensor.

    Arguments as :func:`broadcast_async_`; ``tensor`` is left as it is.
    ``synchronize(handle)`` returns a new tensor holding the root's values."""
    return broadcast_async_(tensor.detach().clone(), root_rank, name, process_set)


def alltoall_async(
    tensor, splits=None, name=None, process_set: ProcessSet = global_process_set
) -> int:
    """Start an alltoall: send ``splits[i]`` rows of ``tensor`` to the i-th rank of the set.

    ``splits`` (a list or 1-D tensor, one non-negative entry per rank of
    ``process_set``, summing to ``tensor.shape[0]``); None splits dimension 0 evenly.
    Returns a handle; ``synchronize(handle)`` returns the rows received from every
    rank, in rank order, and also the received splits when ``splits`` was given."""
    _check_tensor(tensor, "alltoall")
    ps = check_process_set(process_set, "alltoall")
    n = process_set.size() if process_set is not None else size()
    rows = tensor.shape[0] if tensor.dim() else 0
    if splits is None:
        if rows % n:
            raise ValueError(
                f"alltoall without splits needs the first dimension ({rows}) to divide by the number "
                f"of ranks ({n}); pass splits= to send uneven parts."
            )
        send = [rows // n] * n
    else:
        send = [int(s) for s in torch.as_tensor(splits).reshape(-1).tolist()]
        if len(send) != n or sum(send) != rows or min(send) < 0:
            raise ValueError(
                f"alltoall splits={send} must have one non-negative entry per rank ({n}) summing to "
                f"the first dimension ({rows})."
            )
    eng = engine()
    name = name or eng.auto_name(_ALLTOALL)
    dtype = tensor.dtype
    want_splits = splits is not None

    def finish(res):
        return (res[0].to(dtype), res[1]) if want_splits else res[0].to(dtype)

    req = _request(_ALLTOALL, name, tensor, ps, splits=tuple(send))
    return _register(eng.submit(Handle(name, _ALLTOALL, tensor=_wire(tensor), finish=finish), req))


def reducescatter_async(
    tensor,
    name=None,
    op=ReduceOp.Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
) -> int:
    """Start a reducescatter: reduce ``tensor`` over the set, keep this rank's slice.

    ``op``: Average (default), Sum, Min, Max or Product; ``prescale_factor`` /
    ``postscale_factor`` scale before and after. Dimension 0 is split as Horovod
    splits it: the first ``rows % size`` ranks get one row more. Returns a handle;
    ``synchronize(handle)`` returns this rank's slice of the reduction."""
    _check_tensor(tensor, "reducescatter")
    if tensor.dim() == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    rop = ReduceOp(int(op))
    if rop not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product):
        # a RuntimeError, as Horovod raises for it
        raise NotImplementedError(
            f"reducescatter supports op=Average, Sum, Min, Max and Product, not {rop.name}; "
            "use allreduce(op=Adasum) for Adasum"
        )
    ps = check_process_set(process_set, "reducescatter")
    eng = engine()
    name = name or eng.auto_name(_REDUCESCATTER)
    req = _request(
        _REDUCESCATTER,
        name,
        tensor,
        ps,
        op=int(rop),
        prescale=float(prescale_factor),
        postscale=float(postscale_factor),
    )
    return _register(
        eng.submit(
            Handle(
                name, _REDUCESCATTER, tensor=_wire(tensor).clone(), finish=_back_to(tensor.dtype)
            ),
            req,
        )
    )


def grouped_reducescatter_async(
    tensors,
    name=None,
    op=ReduceOp.Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor=1.0,
    postscale_factor=1.0,
) -> int:
    """Start a reducescatter of each tensor of ``tensors`` (named ``<name>.<i>``).

    Arguments as :func:`reducescatter_async`. Returns one handle;
    ``synchronize(handle)`` returns the list of this rank's slices."""
    eng = engine()
    base = name or eng.auto_name("grouped_reducescatter")
    hs = [
        synchronize_later(
            reducescatter_async(
                t, f"{base}.{i}", op, process_set, prescale_factor, postscale_factor
            )
        )
        for i, t in enumerate(tensors)
    ]
    return _register(_Group(base, hs))
