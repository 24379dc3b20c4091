"""Ray Train's ``ray.train.torch`` helpers on the ring: prepare_model, prepare_data_loader, get_device.

A Ray Train script ports by changing its imports::

    from ray_runner import prepare_model, prepare_data_loader, get_device

``prepare_model`` is not DistributedDataParallel: it forms the ring (``ringcore.init()``)
if the loop has not, moves the model to :func:`get_device`, broadcasts rank 0's
parameters and buffers, and hooks every parameter so that its gradient is averaged
over the ring (an async allreduce per gradient as backward produces it, all awaited at
the end of backward). The model it returns is the same ``nn.Module`` (there is no
``.module`` wrapper), and buffers (BatchNorm statistics) are not re-broadcast each step
as DDP does; use ``ringcore.torch.SyncBatchNorm`` for synchronized statistics.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["get_device", "prepare_data_loader", "prepare_model"]


def _ring() -> Any:
    import ringcore.torch as hvd

    if not hvd.is_initialized():
        hvd.init()
    return hvd


def get_device() -> Any:
    """This worker's torch device: its GPU (``cuda:<local index>``) when it holds one, else CPU."""
    import torch

    if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES", "") not in ("", "-1"):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def prepare_model(model: Any, move_to_device: bool = True) -> Any:
    """Rank 0's weights on every rank and gradients averaged over the ring (see module doc)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model takes a torch.nn.Module, got {type(model).__name__}")
    hvd = _ring()
    if move_to_device:
        model = model.to(get_device())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    if hvd.size() == 1 or getattr(model, "_ring_prepared", False):
        return model
    pending: list[int] = []

    def wait_all() -> None:
        while pending:
            hvd.synchronize(pending.pop(0))

    def hook(name: str):
        def averaged(param: torch.Tensor) -> None:
            if not pending:  # the first gradient of this backward: await them all at its end
                torch.autograd.Variable._execution_engine.queue_callback(wait_all)
            pending.append(
                hvd.allreduce_async_(param.grad, op=hvd.Average, name=f"prepare_model.{name}")
            )

        return averaged

    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook(name))
    model._ring_prepared = True
    return model


def prepare_data_loader(data_loader: Any, move_to_device: bool = True) -> Any:
    """The same loader with a ``DistributedSampler`` (this rank's share of the data), shuffled
    when the original was; batches moved to :func:`get_device` when it is a GPU.
    Call ``loader.sampler.set_epoch(epoch)`` each epoch for a new shuffle order."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if not isinstance(data_loader, DataLoader):
        raise TypeError(
            f"prepare_data_loader takes a torch DataLoader, got {type(data_loader).__name__}"
        )
    hvd = _ring()
    if data_loader.batch_size is None:
        raise ValueError(
            "prepare_data_loader needs a DataLoader built with batch_size=... (got a "
            "batch_sampler); build it with batch_size and shuffle instead"
        )
    sampler: DistributedSampler[Any] = DistributedSampler(
        data_loader.dataset,
        num_replicas=hvd.size(),
        rank=hvd.rank(),
        shuffle=isinstance(data_loader.sampler, RandomSampler),
    )
    loader = DataLoader(
        data_loader.dataset,
        batch_size=data_loader.batch_size,
        sampler=sampler,
        num_workers=data_loader.num_workers,
        collate_fn=data_loader.collate_fn,
        pin_memory=data_loader.pin_memory,
        drop_last=data_loader.drop_last,
        timeout=data_loader.timeout,
        worker_init_fn=data_loader.worker_init_fn,
    )
    device = get_device()
    if not move_to_device or device.type == "cpu":
        return loader
    return _OnDevice(loader, device)


class _OnDevice:
    """A loader whose batches (tensors, or tuples/lists/dicts of them) land on ``device``."""

    def __init__(self, loader: Any, device: Any):
        self.loader, self.device = loader, device
        self.sampler = loader.sampler
        self.dataset = loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            yield _move(batch, self.device)


def _move(batch: Any, device: Any) -> Any:
    if hasattr(batch, "to"):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        return type(batch)(_move(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: _move(v, device) for k, v in batch.items()}
    return batch
