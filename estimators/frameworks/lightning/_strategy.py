"""``RingStrategy``: a ``lightning.Trainer`` strategy whose processes are the ring's ranks.

The ring is formed before the Trainer exists (``ringcore.init()`` in the Spark task),
so this strategy launches nothing and opens no process group: rank, world size and
local rank come from ``ringcore.torch``. Gradients are averaged by the ring in
``post_backward``, as DDP averages them during backward: every ``backward`` /
``manual_backward`` ends there, before the precision plugin unscales or clips and
before any optimizer steps, so AMP, ``gradient_clip_val``, gradient-norm logging and
several optimizers under manual optimization all see the averaged gradients. Inside
``block_backward_sync()`` (Lightning enters it for the micro-batches of
``accumulate_grad_batches`` that do not step, and manual optimization through
``optimizer.toggle_model(sync_grad=False)``) nothing is sent: the next synced backward
averages the sum. Averaging is linear, so a gradient already averaged (the same on
every rank) and accumulated again also averages right (a GAN's two losses).
Lightning's metric sync (``self.log(..., sync_dist=True)``), ``all_gather``,
``barrier``, ``broadcast`` and ``reduce_boolean_decision`` (``EarlyStopping``,
``ModelCheckpoint``) go through the ring's collectives.

Lightning ships as ``lightning.pytorch`` and as ``pytorch_lightning``, with distinct
classes; :func:`ring_strategy` builds the strategy for the package of the module being
fitted (:func:`lightning_package`). Nothing here imports Lightning at import time, and
this module is imported only where a LightningModule is trained.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

import ringcore.torch as hvd

__all__ = ["average_gradients", "lightning_package", "ring_strategy"]

_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def lightning_package(module: Any) -> Any:
    """``lightning.pytorch`` or ``pytorch_lightning``: the package whose LightningModule
    ``module`` is (the package is imported already: ``module`` exists)."""
    for name in _PACKAGES:
        package = sys.modules.get(name)
        cls = getattr(package, "LightningModule", None)
        if cls is not None and isinstance(module, cls):
            return package
    raise TypeError(f"{type(module).__name__} is not a LightningModule of {' or '.join(_PACKAGES)}")


def average_gradients(module: torch.nn.Module) -> None:
    """Average every parameter's gradient over the ranks in place: one allreduce per
    dtype, of the gradients flattened in parameter order (the same on every rank)."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for param in module.parameters():
        if param.grad is not None:
            by_dtype.setdefault(param.grad.dtype, []).append(param.grad)
    for dtype, grads in sorted(by_dtype.items(), key=lambda item: str(item[0])):
        flat = torch.cat([g.reshape(-1) for g in grads])
        flat = hvd.allreduce(flat, op=hvd.Average, name=f"ringtrain.lightning.grads.{dtype}")
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


def _op(reduce_op: Any) -> Any:
    """Lightning's reduce op ("mean", "sum", "max", "min", a torch ReduceOp, or None,
    which Lightning's own strategies take as a sum) as ours."""
    if reduce_op is None:
        return hvd.Sum
    name = str(getattr(reduce_op, "name", reduce_op)).lower()
    ops = {"mean": hvd.Average, "avg": hvd.Average, "sum": hvd.Sum, "max": hvd.Max, "min": hvd.Min}
    if name not in ops:
        raise ValueError(
            f"RingStrategy.reduce: reduce_op {reduce_op!r} is not one of {sorted(ops)}"
        )
    return ops[name]


def _set_rank_zero(rank: int) -> None:
    """Lightning's ``rank_zero_only`` (its info lines, the loggers' writes) on rank 0
    only, as its DDP strategy sets it."""
    for name in (
        "lightning_utilities.core.rank_zero",
        "lightning.fabric.utilities.rank_zero",
        "lightning.pytorch.utilities.rank_zero",
        "lightning_fabric.utilities.rank_zero",
        "pytorch_lightning.utilities.rank_zero",
    ):
        fn = getattr(sys.modules.get(name), "rank_zero_only", None)
        if fn is not None:
            fn.rank = rank


_CLASSES: dict[str, type] = {}


def ring_strategy(package: Any, device: torch.device) -> Any:
    """A ``RingStrategy`` of ``package`` (``lightning.pytorch`` or ``pytorch_lightning``)
    training on ``device``; ``ringcore.init()`` must have run."""
    if not hvd.is_initialized():
        raise RuntimeError(
            "RingStrategy needs the ring: call ringcore.torch.init() in every process "
            "before building the lightning.Trainer."
        )
    name = package.__name__
    if name not in _CLASSES:
        _CLASSES[name] = _define(package.strategies.ParallelStrategy)
    _set_rank_zero(hvd.rank())
    return _CLASSES[name](device)


def _define(base: Any) -> type:
    """The strategy class on ``base`` (the package's ``ParallelStrategy``)."""

    class RingStrategy(base):
        """One Trainer process per ring rank (see the module docstring)."""

        strategy_name = "ringtrain"

        def __init__(self, device: torch.device) -> None:
            super().__init__(parallel_devices=[device])
            self._root_device = device
            self._calls = 0  # names the collectives: every rank calls them in the same order
            self._blocked = 0  # inside block_backward_sync(): no gradient averaging

        def _name(self, what: str) -> str:
            self._calls += 1
            return f"ringtrain.lightning.{what}.{self._calls}"

        # --- who am I -------------------------------------------------------------------

        @property
        def root_device(self) -> torch.device:
            return self._root_device

        @property
        def global_rank(self) -> int:
            return hvd.rank()

        @property
        def local_rank(self) -> int:
            return hvd.local_rank()

        @property
        def node_rank(self) -> int:
            return hvd.cross_rank()

        @property
        def world_size(self) -> int:
            return hvd.size()

        @property
        def is_global_zero(self) -> bool:
            return hvd.rank() == 0

        @property
        def is_distributed(self) -> bool:
            """Read by Lightning's accelerator connector: ``self.log(..., sync_dist=True)``
            syncs only under a strategy that says it is distributed."""
            return True

        @property
        def distributed_sampler_kwargs(self) -> dict[str, Any]:
            return {"num_replicas": hvd.size(), "rank": hvd.rank()}

        # --- set-up -----------------------------------------------------------------------

        def setup_environment(self) -> None:
            _set_rank_zero(hvd.rank())
            super().setup_environment()

        def model_to_device(self) -> None:
            assert self.model is not None
            self.model.to(self.root_device)

        def setup(self, trainer: Any) -> None:
            """Lightning's set-up (precision, device, optimizers), then every rank starts
            from rank 0's parameters. A resumed fit restores the same checkpoint on every
            rank (weights before this, optimizers and loops after)."""
            super().setup(trainer)
            assert self.model is not None
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)

        # --- gradients --------------------------------------------------------------------

        def post_backward(self, closure_loss: torch.Tensor) -> None:
            assert self.model is not None
            if not self._blocked:
                average_gradients(self.model)

        @contextmanager
        def block_backward_sync(self) -> Iterator[None]:
            """Backward passes in here keep their gradients local (accumulation); the
            first one after it averages what was accumulated."""
            self._blocked += 1
            try:
                yield None
            finally:
                self._blocked -= 1

        # --- collectives ------------------------------------------------------------------

        def reduce(self, tensor: Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
            if not isinstance(tensor, torch.Tensor):
                return tensor
            op = _op(reduce_op)
            source = tensor.detach()
            if op is hvd.Average and not source.is_floating_point():
                source = source.to(torch.float32)
            if hvd.size() == 1:
                return source
            return hvd.allreduce(source, op=op, name=self._name("reduce"))

        def all_gather(
            self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False
        ) -> torch.Tensor:
            """``(world_size, *tensor.shape)``: every rank's ``tensor``, in rank order
            (no gradient flows back through it: ``sync_grads`` is not offered)."""
            if sync_grads:
                raise NotImplementedError(
                    "RingStrategy.all_gather(sync_grads=True): gradients do not flow back "
                    "through the ring's allgather; gather detached tensors."
                )
            return hvd.allgather(tensor.detach().unsqueeze(0), name=self._name("all_gather"))

        def barrier(self, name: str | None = None) -> None:
            if hvd.is_initialized() and hvd.size() > 1:
                hvd.barrier()

        def broadcast(self, obj: Any, src: int = 0) -> Any:
            if hvd.size() == 1:
                return obj
            return hvd.broadcast_object(obj, root_rank=src, name=self._name("broadcast"))

        def teardown(self) -> None:
            """Lightning's own teardown (the model back to the CPU, the accelerator's); the
            ring stays up: the Spark task that formed it shuts it down."""
            super().teardown()

    return RingStrategy
