"""``DistributedOptimizer``: averages gradients over all ranks before each step.

This first cut reduces every gradient at ``step()`` — packed into one flat buffer
per dtype, so one collective per dtype — rather than overlapping with backward;
the op engine adds per-parameter hooks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

import torch

from .._ops import ReduceOp
from .._process_sets import ProcessSet, check_process_set, global_process_set
from .._runtime import size
from ._collectives import allreduce_
from ._compression import Compression, Compressor

__all__ = ["DistributedOptimizer"]


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        process_set,
        sparse_as_dense,
    ):
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]  # the wrapped optimizer's own class
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._synchronized = False
        self._should_synchronize = True
        all_params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            names = [n for n, _ in named]
            dupes = sorted({n for n in names if names.count(n) > 1})
            if dupes:
                raise ValueError(
                    f"named_parameters has duplicate names {dupes}; give each parameter a unique name."
                )
            known = {id(p) for _, p in named}
            missing = [i for i, p in enumerate(all_params) if id(p) not in known]
            if missing:
                raise ValueError(
                    f"named_parameters does not cover every optimizer parameter ({len(missing)} missing); "
                    "pass model.named_parameters() of the model the optimizer was built on."
                )

    def _reduce_all(self) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        if not params or size() == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad.is_sparse:
                if not self._sparse_as_dense:
                    raise ValueError(
                        "a parameter has a sparse gradient (an nn.Embedding(sparse=True)?); "
                        "pass sparse_as_dense=True to DistributedOptimizer."
                    )
                p.grad = p.grad.to_dense()
            by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        pre, post = 1.0, 1.0
        if self._op == ReduceOp.Average and self._predivide != 1.0:
            pre, post = 1.0 / self._predivide, self._predivide
        for group in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in group])
            wire, ctx = self._compression.compress(flat)
            allreduce_(
                wire,
                op=self._op,
                prescale_factor=pre,
                postscale_factor=post,
                process_set=self._process_set,
            )
            flat = self._compression.decompress(wire, ctx)
            offset = 0
            for g in group:
                n = g.numel()
                g.copy_(flat[offset : offset + n].view_as(g))
                offset += n

    def synchronize(self) -> None:
        """Reduce the gradients now (e.g. before clipping); pair with skip_synchronize()."""
        with torch.no_grad():
            self._reduce_all()
        self._synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``step()`` inside this block does not reduce again (after synchronize())."""
        self._should_synchronize = False
        try:
            yield
        finally:
            self._should_synchronize = True

    def step(self, closure=None):
        if self._should_synchronize:
            if self._synchronized:
                raise RuntimeError(
                    "optimizer.step() called after optimizer.synchronize() without "
                    "`with optimizer.skip_synchronize():`; gradients would be reduced twice. "
                    "Wrap step() in skip_synchronize()."
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self._synchronized = False
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
    compression: type[Compressor] = Compression.none,
    backward_passes_per_step: int = 1,
    op: ReduceOp | int = ReduceOp.Average,
    gradient_predivide_factor: float = 1.0,
    num_groups: int = 0,
    groups=None,
    sparse_as_dense: bool = False,
    process_set: ProcessSet = global_process_set,
) -> torch.optim.Optimizer:
    """Wrap ``optimizer`` so that ``step()`` uses gradients averaged over all ranks.

    The result is an instance of a subclass of the optimizer's own class (as in
    Horovod), so ``isinstance`` checks and LR schedulers keep working.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    if gradient_predivide_factor != 1.0 and ReduceOp(int(op)) != ReduceOp.Average:
        raise ValueError("gradient_predivide_factor only applies with op=Average")
    check_process_set(process_set)
    cls = type(
        optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__)
    )
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        ReduceOp(int(op)),
        gradient_predivide_factor,
        process_set,
        sparse_as_dense,
    )
