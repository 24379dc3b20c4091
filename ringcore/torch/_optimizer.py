"""``DistributedOptimizer``: gradients averaged over all ranks, overlapping backward.

As Horovod's: a post-accumulate-grad hook on every parameter submits that gradient's
allreduce as soon as backward has produced it (after ``backward_passes_per_step``
passes), so communication runs while the rest of backward computes; ``step()``
waits for the handles, then applies the wrapped optimizer's update. The engine fuses
the gradients that are ready together into one buffer.

On GPU nothing here changes: each hook's submission records a CUDA event on the
backward stream, and the engine runs the fusion copy, the scaling and the NCCL
allreduce on its own side stream after that event (``ringcore.engine.cuda_streams``), so backward
kernels queued later do not wait for communication; ``step()``'s synchronize makes
the optimizer's stream wait for the side stream before the update reads the
gradients. The fusion buffer lives on the gradients' device. Under Gloo (no NCCL, or
ranks sharing a GPU) each fused buffer is copied to host memory and back instead,
which serializes with the host.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable
from typing import Any

import torch

from .._ops import ReduceOp
from ..runtime.process_sets import ProcessSet, check_process_set, global_process_set
from ..runtime.state import size
from ._async import _allreduce_start, grouped_allreduce_async_
from ._compression import Compression, Compressor
from ._handles import discard, synchronize
from ._sparse import sparse_allreduce_async

__all__ = ["DistributedOptimizer"]

_TOO_MANY = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)


class _DistributedOptimizer(torch.optim.Optimizer):
    def __init__(
        self,
        params,
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
    ):
        super(self.__class__, self).__init__(params)  # type: ignore[call-arg]  # the wrapped class
        self._compression = compression
        self._op = op
        self._predivide = gradient_predivide_factor
        self._process_set = process_set
        self._sparse_as_dense = sparse_as_dense
        self.backward_passes_per_step = backward_passes_per_step
        self._names = _parameter_names(self.param_groups, named_parameters)
        self._parameter_names = self._names  # Horovod's attribute: {parameter: name}
        self._groups = _parameter_groups(self.param_groups, groups)
        self._group_of = {p: i for i, g in enumerate(self._groups) for p in g}
        self._group_ready: dict[int, set] = {}
        self._delay = {p: backward_passes_per_step for g in self.param_groups for p in g["params"]}
        self._handles: dict[Any, tuple[Any, Any]] = {}
        self._synchronized = False
        self._should_synchronize = True
        self._hooks = []
        # A rank outside the process set keeps its own gradients (as Horovod): no hooks.
        self._included = process_set.included()
        if size() > 1 and self._included:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.requires_grad:
                        self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook()))

    # -- hooks: start each allreduce as soon as its gradient is ready ----------------------
    def _make_hook(self):
        def hook(p: torch.Tensor) -> None:
            if self._delay[p] <= 0:
                raise AssertionError(_TOO_MANY)
            self._delay[p] -= 1
            if self._delay[p] == 0:
                self._submit(p)

        return hook

    def _scales(self) -> tuple[float, float]:
        if self._op == ReduceOp.Average and self._predivide != 1.0:
            return 1.0 / self._predivide, self._predivide
        return 1.0, 1.0

    def _submit(self, p: torch.Tensor) -> None:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            if not self._sparse_as_dense:
                self._handles[p] = (
                    sparse_allreduce_async(grad, self._names[p], self._op, self._process_set),
                    "sparse",
                )
                return
            grad = grad.to_dense()  # reduced dense; step() gets it back as a sparse grad
        if p in self._group_of:
            gid = self._group_of[p]
            ready = self._group_ready.setdefault(gid, set())
            ready.add(p)
            if len(ready) == len(self._groups[gid]):
                self._submit_group(gid)
            else:
                self._handles[p] = (None, None)  # waits for the rest of its group
            return
        wire, ctx = self._compression.compress(grad)
        pre, post = self._scales()
        handle = _allreduce_start(  # allreduce_async_, held for step()'s wait
            wire,
            None,
            f"allreduce.{self._names[p]}",
            self._op,
            pre,
            post,
            self._process_set,
            inplace=True,
            now=False,
            held=True,
        )
        self._handles[p] = (handle, (wire, ctx))

    def _submit_group(self, gid: int) -> None:
        params = self._groups[gid]
        packed = [self._compression.compress(p.grad) for p in params]
        pre, post = self._scales()
        handle = grouped_allreduce_async_(
            [w for w, _ in packed],
            name=f"allreduce.group.{gid}",
            op=self._op,
            prescale_factor=pre,
            postscale_factor=post,
            process_set=self._process_set,
        )
        self._handles[params[0]] = (handle, ("group", gid, packed))
        for p in params[1:]:
            self._handles[p] = (handle, ("member", gid))
        self._group_ready.pop(gid, None)

    # -- synchronize / step ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Wait for every gradient's allreduce (submitting any not yet started, e.g. of
        parameters that got no gradient); the grads then hold the averages."""
        if size() == 1 or not self._included:
            self._synchronized = True
            return
        for group in self.param_groups:
            for p in group["params"]:
                if not p.requires_grad:
                    continue
                if p not in self._handles or self._handles[p][0] is None:
                    if p in self._group_of:
                        for q in self._groups[self._group_of[p]]:
                            if q not in self._handles:
                                self._group_ready.setdefault(self._group_of[p], set()).add(q)
                                if q.grad is None:
                                    q.grad = torch.zeros_like(q)
                        self._submit_group(self._group_of[p])
                    else:
                        self._submit(p)
        try:
            self._wait_for_handles()
        except BaseException:
            # The ring failed (e.g. RingInternalError after a peer died): forget the
            # handles of this step so that an elastic reset can zero_grad() and go on.
            self._forget_pending()
            raise
        self._handles.clear()
        self._delay = dict.fromkeys(self._delay, self.backward_passes_per_step)
        self._synchronized = True

    def _forget_pending(self) -> None:
        for handle, _ctx in self._handles.values():
            if handle is not None:
                discard(handle)
        self._handles.clear()
        self._group_ready.clear()
        self._delay = dict.fromkeys(self._delay, self.backward_passes_per_step)
        self._synchronized = False

    def _wait_for_handles(self) -> None:
        with torch.no_grad():
            for p, (handle, ctx) in list(self._handles.items()):
                if ctx == "sparse":
                    p.grad = synchronize(handle)
                elif isinstance(ctx, tuple) and ctx[0] == "group":
                    outs = synchronize(handle)
                    for q, out, (_, c) in zip(self._groups[ctx[1]], outs, ctx[2]):
                        assert q.grad is not None
                        q.grad.copy_(self._compression.decompress(out, c))
                elif isinstance(ctx, tuple) and ctx[0] == "member":
                    continue
                else:
                    _wire, c = ctx
                    out = synchronize(handle)
                    if p.grad.is_sparse:  # sparse_as_dense: the optimizer wants it sparse
                        p.grad = self._compression.decompress(out, c).to_sparse()
                    elif out.data_ptr() != p.grad.data_ptr():
                        p.grad.copy_(self._compression.decompress(out, c))

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
                warnings.warn(
                    "optimizer.step() called without optimizer.skip_synchronize() context after "
                    "optimizer.synchronize(): the gradients are reduced a second time, which "
                    "slows training. Call step() inside `with optimizer.skip_synchronize():`.",
                    stacklevel=2,
                )
            self.synchronize()
        self._synchronized = False
        return super(self.__class__, self).step(closure)

    def zero_grad(self, set_to_none: bool = True):
        if self._handles:
            raise AssertionError(
                "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() "
                "or optimizer.synchronize(); gradients are still being reduced. Call step() first."
            )
        return super(self.__class__, self).zero_grad(set_to_none=set_to_none)


def _parameter_names(param_groups, named_parameters) -> dict:
    all_params = [p for g in param_groups for p in g["params"]]
    if named_parameters is None:  # as Horovod: by param group and position in it
        return {
            p: f"noname.{i}.{j}"
            for i, group in enumerate(param_groups)
            for j, p in enumerate(group["params"])
        }
    named = list(named_parameters)
    if named and not (isinstance(named[0], tuple) and len(named[0]) == 2):
        raise ValueError(
            "named_parameters should be a sequence of (name, parameter) tuples, as model.named_parameters() gives"
        )
    names = [n for n, _ in named]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(
            f"Parameter names in named_parameters must be unique. Found duplicates: {', '.join(dupes)}"
        )
    by_param = {p: n for n, p in named}
    missing = [i for i, p in enumerate(all_params) if p not in by_param]
    if missing:
        raise ValueError(
            f"named_parameters was specified, but {len(missing)} optimizer parameter(s) are not in it; "
            "pass model.named_parameters() of the model the optimizer was built on."
        )
    return by_param


def _parameter_groups(param_groups, groups) -> list[list[torch.Tensor]]:
    if groups is None:
        return []
    all_params = [p for g in param_groups for p in g["params"] if p.requires_grad]
    if isinstance(groups, int):
        if groups <= 0:
            return []
        k = max(1, -(-len(all_params) // groups))
        return [all_params[i : i + k] for i in range(0, len(all_params), k)]
    out = [list(g) for g in groups]
    known = set(all_params)
    for g in out:
        for p in g:
            if p not in known:
                raise ValueError("groups lists a tensor that is not a parameter of this optimizer")
    return out


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
    Horovod), so ``isinstance`` checks and LR schedulers keep working. ``num_groups``
    splits the parameters into that many fused groups; ``groups`` lists them.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"DistributedOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if backward_passes_per_step < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    rop = ReduceOp(int(op))
    if gradient_predivide_factor != 1.0 and rop != ReduceOp.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if num_groups and groups is not None:
        raise ValueError("pass either num_groups or groups, not both")
    process_set = process_set if process_set is not None else global_process_set
    # a rank outside the set only keeps its own gradients; the others check the set
    if not isinstance(process_set, ProcessSet) or process_set.included():
        check_process_set(process_set, "DistributedOptimizer")
    cls = type(
        optimizer.__class__.__name__, (optimizer.__class__,), dict(_DistributedOptimizer.__dict__)
    )
    return cls(
        optimizer.param_groups,
        named_parameters,
        compression,
        backward_passes_per_step,
        rop,
        gradient_predivide_factor,
        groups if groups is not None else (num_groups or None),
        sparse_as_dense,
        process_set,
    )
