"""Ray Train's ``ray.train.torch`` data helpers on the ring: prepare_data_loader, get_device.

A Ray Train script ports by changing its imports::

    from ray_runner import prepare_model, prepare_data_loader, get_device

``prepare_model`` and the state functions that go with it are in ``_model``.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["get_device", "prepare_data_loader", "ring"]


def ring() -> Any:
    """``ringcore.torch``, the ring formed (``ringcore.init()``) if the loop has not."""
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


def prepare_data_loader(data_loader: Any, move_to_device: bool = True) -> Any:
    """The same loader with a ``DistributedSampler`` (this rank's share of the data), shuffled
    when the original was; batches moved to :func:`get_device` when it is a GPU.
    Call ``loader.sampler.set_epoch(epoch)`` each epoch for a new shuffle order."""
    from torch.utils.data import DataLoader, DistributedSampler, RandomSampler

    if not isinstance(data_loader, DataLoader):
        raise TypeError(
            f"prepare_data_loader takes a torch DataLoader, got {type(data_loader).__name__}"
        )
    hvd = ring()
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
