"""``ddp``: torch's ``DistributedDataParallel`` on the job's ranks (on the CPU, over the
backend ``"ring"``: ``_group.strategy_group``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._base import Prepared, Strategy
from ._group import device_of, ensure_process_group, strategy_group


class DdpStrategy(Strategy):
    name = "ddp"

    def prepare(
        self, model: Any, optimizer: Any = None, *, config: Any = None,
        backward_passes_per_step: int = 1,
    ) -> Prepared:  # fmt: skip
        from torch.nn.parallel import DistributedDataParallel

        self.check(model, config)
        ensure_process_group()
        device = device_of(model)
        ids = [device.index if device.index is not None else 0] if device.type == "cuda" else None
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"strategy='ddp' needs a model with trainable parameters; "
                f"{type(model).__name__} has none"
            )
        # broadcasts rank 0's state; on the CPU, through ringcore's shared memory
        wrapped = DistributedDataParallel(
            model, device_ids=ids, process_group=strategy_group(device)
        )
        if optimizer is not None:
            _same_optimizer_state(optimizer)
        return Prepared(self, wrapped, model, optimizer)

    @contextlib.contextmanager
    def no_sync(self, run: Prepared) -> Iterator[None]:
        with run.model.no_sync():
            yield


def _same_optimizer_state(optimizer: Any) -> None:
    """Rank 0's optimizer state (a resumed one) on every rank, as ring's
    ``broadcast_optimizer_state`` (DDP broadcasts the module only)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return
    state = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(state, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(state[0])
