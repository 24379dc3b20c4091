"""``SyncBatchNorm``: batch normalization with statistics over every rank's batch.

Forward allreduces each channel's row count, sum and sum of squares once; backward
allreduces the sums of ``dy`` and ``dy * x_hat`` once. The result equals
``BatchNorm`` on the concatenation of every rank's batch (in eval mode it is plain
BatchNorm with the running statistics).
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from .._ops import ReduceOp
from ..runtime.state import size
from ._collectives import allreduce

__all__ = ["SyncBatchNorm"]


def _channels_last(x: torch.Tensor) -> torch.Tensor:
    """(N, C, *) -> (N * prod(*), C)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1).t()


def _view(stat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return stat.view(1, -1, *([1] * (like.dim() - 2)))


class _SyncBatchNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, eps, momentum, name):
        flat = _channels_last(x)
        count = torch.tensor([float(flat.shape[0])], dtype=flat.dtype)
        stats = torch.cat([count, flat.sum(0), (flat * flat).sum(0)])
        stats = allreduce(stats.detach(), op=ReduceOp.Sum, name=f"{name}.forward")
        c = x.shape[1]
        total = stats[0]
        mean = stats[1 : 1 + c] / total
        var = (stats[1 + c :] / total - mean * mean).clamp_min(0)
        invstd = torch.rsqrt(var + eps)
        if running_mean is not None:
            with torch.no_grad():
                unbiased = var * total / max(float(total) - 1, 1.0)
                running_mean.mul_(1 - momentum).add_(momentum * mean)
                running_var.mul_(1 - momentum).add_(momentum * unbiased)
        xhat = (x - _view(mean, x)) * _view(invstd, x)
        out = xhat
        if weight is not None:
            out = out * _view(weight, x) + _view(bias, x)
        ctx.save_for_backward(xhat, weight, invstd, total)
        ctx.name = name
        return out

    @staticmethod
    def backward(ctx, dy):
        xhat, weight, invstd, total = ctx.saved_tensors
        dxhat = dy * _view(weight, dy) if weight is not None else dy
        flat_dxhat, flat_xhat = _channels_last(dxhat), _channels_last(xhat)
        local = torch.cat([flat_dxhat.sum(0), (flat_dxhat * flat_xhat).sum(0)])
        sums = allreduce(local.detach(), op=ReduceOp.Sum, name=f"{ctx.name}.backward")
        c = dy.shape[1]
        sum_dxhat, sum_dxhat_xhat = sums[:c], sums[c:]
        dx = (
            _view(invstd, dy)
            / total
            * (total * dxhat - _view(sum_dxhat, dy) - xhat * _view(sum_dxhat_xhat, dy))
        )
        dweight = dbias = None
        if weight is not None:
            flat_dy = _channels_last(dy)
            dweight = (flat_dy * flat_xhat).sum(0)
            dbias = flat_dy.sum(0)
        return dx, dweight, dbias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    """Drop-in for ``torch.nn.BatchNorm{1,2,3}d`` whose batch statistics span all ranks."""

    _instances = 0

    def __init__(
        self,
        num_features,
        eps=1e-5,
        momentum=0.1,
        affine=True,
        track_running_stats=True,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        SyncBatchNorm._instances += 1
        # one name per layer: forward/backward reuse it, so the response cache serves them
        self._ring_name = f"sync_batch_norm.{SyncBatchNorm._instances}"

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if not self.training or size() == 1:
            return super().forward(input)
        if self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is not None:
            momentum = self.momentum
        else:  # cumulative moving average, as BatchNorm with momentum=None
            assert self.num_batches_tracked is not None
            momentum = 1.0 / float(self.num_batches_tracked)
        return _SyncBatchNormFn.apply(
            input,
            self.weight,
            self.bias,
            self.running_mean,
            self.running_var,
            self.eps,
            momentum,
            self._ring_name,
        )
