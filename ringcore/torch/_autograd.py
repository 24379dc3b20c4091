"""Gradients of the collectives, as Horovod defines them.

- allreduce: the gradient is the allreduce of the incoming gradient (same op and scale factors);
- allgather: the average of the incoming gradients over ranks, this rank's rows of it;
- broadcast: the average of the incoming gradients on the root, zeros elsewhere;
- alltoall: the incoming gradient sent back along the received splits;
- reducescatter: the allgather of the incoming gradient, times the set's size for Sum
  (and times the scale factors);
- the grouped ops: the gradient of each tensor as for its single op, reduced as one group.

The blocking functions of ``ringcore.torch`` route through these when the input
requires grad and grad mode is on.
"""

from __future__ import annotations

import torch

from .._ops import ReduceOp
from ..runtime.state import rank
from ._async import (
    allgather_async,
    allreduce_async,
    alltoall_async,
    broadcast_async,
    grouped_allgather_async,
    grouped_allreduce_async,
    grouped_reducescatter_async,
    reducescatter_async,
)
from ._handles import synchronize


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale, process_set):
        ctx.args = (average, op, prescale, postscale, process_set)
        return synchronize(
            allreduce_async(tensor, average, name, op, prescale, postscale, process_set)
        )

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, process_set = ctx.args
        out = synchronize(
            allreduce_async(grad.contiguous(), average, None, op, prescale, postscale, process_set)
        )
        return out, None, None, None, None, None, None


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return synchronize(allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(
            allreduce_async(
                grad.contiguous(), None, None, ReduceOp.Average, 1.0, 1.0, ctx.process_set
            )
        )
        rows = synchronize(allgather_async(torch.tensor([ctx.rows]), None, ctx.process_set))
        me = ctx.process_set.rank()
        offset = int(rows[:me].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return synchronize(broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = synchronize(
            allreduce_async(
                grad.contiguous(), None, None, ReduceOp.Average, 1.0, 1.0, ctx.process_set
            )
        )
        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = synchronize(
            alltoall_async(
                tensor,
                splits if splits is not None else _even(tensor, process_set),
                name,
                process_set,
            )
        )
        ctx.received, ctx.process_set = received, process_set
        ctx.mark_non_differentiable(received)
        return out, received

    @staticmethod
    def backward(ctx, grad, _grad_splits):
        back, _ = synchronize(
            alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set)
        )
        return back, None, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.op, ctx.process_set, ctx.scale = ReduceOp(int(op)), process_set, prescale * postscale
        return synchronize(reducescatter_async(tensor, name, op, process_set, prescale, postscale))

    @staticmethod
    def backward(ctx, grad):
        gathered = synchronize(allgather_async(grad.contiguous(), None, ctx.process_set))
        return gathered * _reducescatter_grad_scale(ctx), None, None, None, None, None


def _reducescatter_grad_scale(ctx) -> float:
    """Horovod's reducescatter gradient: allgather(grad), times the set's size for Sum."""
    factor = float(ctx.process_set.size()) if ctx.op == ReduceOp.Sum else 1.0
    return factor * ctx.scale


class GroupedAllreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, average, name, op, prescale, postscale, process_set, *tensors):
        ctx.args = (average, op, prescale, postscale, process_set)
        return tuple(
            synchronize(
                grouped_allreduce_async(
                    list(tensors), average, name, op, prescale, postscale, process_set
                )
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        average, op, prescale, postscale, process_set = ctx.args
        reduced = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads], average, None, op, prescale, postscale, process_set
            )
        )
        return (None, None, None, None, None, None, *reduced)


class GroupedAllgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, process_set, *tensors):
        ctx.rows, ctx.process_set = [t.shape[0] for t in tensors], process_set
        return tuple(synchronize(grouped_allgather_async(list(tensors), name, process_set)))

    @staticmethod
    def backward(ctx, *grads):
        ps = ctx.process_set
        reduced = synchronize(
            grouped_allreduce_async(
                [g.contiguous() for g in grads], None, None, ReduceOp.Average, 1.0, 1.0, ps
            )
        )
        rows = synchronize(allgather_async(torch.tensor([ctx.rows]), None, ps))
        offsets = rows[: ps.rank()].sum(dim=0).tolist() if ps.rank() else [0] * len(ctx.rows)
        parts = [r.narrow(0, int(o), n) for r, o, n in zip(reduced, offsets, ctx.rows)]
        return (None, None, *parts)


class GroupedReducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, name, op, process_set, prescale, postscale, *tensors):
        ctx.op, ctx.process_set, ctx.scale = ReduceOp(int(op)), process_set, prescale * postscale
        return tuple(
            synchronize(
                grouped_reducescatter_async(
                    list(tensors), name, op, process_set, prescale, postscale
                )
            )
        )

    @staticmethod
    def backward(ctx, *grads):
        gathered = synchronize(
            grouped_allgather_async([g.contiguous() for g in grads], None, ctx.process_set)
        )
        scale = _reducescatter_grad_scale(ctx)
        return (None, None, None, None, None, *(g * scale for g in gathered))


def _even(tensor: torch.Tensor, process_set) -> list[int]:
    n = process_set.size()
    return [tensor.shape[0] // n] * n


def differentiable(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()


def any_differentiable(tensors) -> bool:
    return torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in tensors
    )
