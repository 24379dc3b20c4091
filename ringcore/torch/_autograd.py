"""Gradients of the collectives, as Horovod defines them.

- allreduce: the gradient is the allreduce of the incoming gradient (same op and scale factors);
- allgather: the average of the incoming gradients over ranks, this rank's rows of it;
- broadcast: the average of the incoming gradients on the root, zeros elsewhere;
- alltoall: the incoming gradient sent back along the received splits;
- reducescatter: the allgather of the incoming gradient (divided by the set's size for Average).

The blocking functions of ``ringcore.torch`` route through these when the input
requires grad and grad mode is on.
"""

from __future__ import annotations

import torch

from .._ops import ReduceOp
from . import _collectives as c


class Allreduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, average, name, op, prescale, postscale, process_set):
        ctx.args = (average, op, prescale, postscale, process_set)
        return c.synchronize(
            c.allreduce_async(tensor, average, name, op, prescale, postscale, process_set)
        )

    @staticmethod
    def backward(ctx, grad):
        average, op, prescale, postscale, process_set = ctx.args
        out = c.synchronize(
            c.allreduce_async(
                grad.contiguous(), average, None, op, prescale, postscale, process_set
            )
        )
        return out, None, None, None, None, None, None


class Allgather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, process_set):
        ctx.rows, ctx.process_set = tensor.shape[0], process_set
        return c.synchronize(c.allgather_async(tensor, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = c.synchronize(
            c.allreduce_async(
                grad.contiguous(), None, None, ReduceOp.Average, 1.0, 1.0, ctx.process_set
            )
        )
        rows = c.synchronize(c.allgather_async(torch.tensor([ctx.rows]), None, ctx.process_set))
        me = ctx.process_set.rank()
        offset = int(rows[:me].sum())
        return reduced.narrow(0, offset, ctx.rows), None, None


class Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, root_rank, name, process_set):
        ctx.root_rank, ctx.process_set = root_rank, process_set
        return c.synchronize(c.broadcast_async(tensor, root_rank, name, process_set))

    @staticmethod
    def backward(ctx, grad):
        reduced = c.synchronize(
            c.allreduce_async(
                grad.contiguous(), None, None, ReduceOp.Average, 1.0, 1.0, ctx.process_set
            )
        )
        from .._runtime import rank

        if rank() != ctx.root_rank:
            reduced = reduced * 0
        return reduced, None, None, None


class Alltoall(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, splits, name, process_set):
        out, received = c.synchronize(
            c.alltoall_async(
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
        back, _ = c.synchronize(
            c.alltoall_async(grad.contiguous(), ctx.received, None, ctx.process_set)
        )
        return back, None, None, None


class Reducescatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, tensor, name, op, process_set, prescale, postscale):
        ctx.op, ctx.process_set, ctx.scale = ReduceOp(int(op)), process_set, prescale * postscale
        return c.synchronize(
            c.reducescatter_async(tensor, name, op, process_set, prescale, postscale)
        )

    @staticmethod
    def backward(ctx, grad):
        gathered = c.synchronize(c.allgather_async(grad.contiguous(), None, ctx.process_set))
        if ctx.op == ReduceOp.Average:
            gathered = gathered / ctx.process_set.size()
        return gathered * ctx.scale, None, None, None, None, None


def _even(tensor: torch.Tensor, process_set) -> list[int]:
    n = process_set.size()
    return [tensor.shape[0] // n] * n


def differentiable(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, torch.Tensor) and tensor.requires_grad and torch.is_grad_enabled()
