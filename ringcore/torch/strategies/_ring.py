"""``ring``: Horovod's way — whole replicas, gradients averaged by ringcore's
``DistributedOptimizer``, rank 0's parameters and optimizer state broadcast first."""

from __future__ import annotations

import contextlib
from typing import Any

from ._base import Prepared, Strategy


class RingStrategy(Strategy):
    name = "ring"

    def prepare(
        self, model: Any, optimizer: Any = None, *, config: Any = None,
        backward_passes_per_step: int = 1,
    ) -> Prepared:  # fmt: skip
        from ... import torch as hvd

        self.check(model, config)
        if not hvd.is_initialized():
            hvd.init()
        hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        if optimizer is not None:
            hvd.broadcast_optimizer_state(optimizer, root_rank=0)
            optimizer.zero_grad(set_to_none=True)  # it leaves zero gradients behind
            if not hasattr(optimizer, "synchronize"):  # not wrapped yet
                optimizer = hvd.DistributedOptimizer(
                    optimizer,
                    named_parameters=model.named_parameters(),
                    backward_passes_per_step=backward_passes_per_step,
                )
        return Prepared(self, model, model, optimizer)

    def before_step(self, run: Prepared) -> None:
        opt = run.optimizer
        if opt is not None and hasattr(opt, "synchronize") and not opt._synchronized:
            opt.synchronize()  # every gradient's allreduce done; step() then skips it

    def step(self, run: Prepared) -> None:
        opt = run.optimizer
        if getattr(opt, "_synchronized", False):
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        opt.zero_grad()

    def local_step(self, run: Prepared) -> contextlib.AbstractContextManager:
        skip = getattr(run.optimizer, "skip_synchronize", None)  # None: not wrapped
        return skip() if skip is not None else contextlib.nullcontext()
