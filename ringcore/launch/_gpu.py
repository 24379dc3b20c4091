"""Pinning this rank's GPU, with its place on the host filled in."""

from __future__ import annotations

from typing import Any

from ..backends import devices
from ..runtime.state import local_position

__all__ = ["pin_gpu"]


def pin_gpu(local_rank: int | None = None, local_size: int | None = None) -> Any:
    """``torch.cuda.set_device`` on this rank's GPU; returns the ``torch.device``.

    ``local_rank``/``local_size`` default to this rank's place on its host: the running
    job's topology (after ``init()``), else ``RING_LOCAL_RANK``/``RING_LOCAL_SIZE``.
    Raises :class:`GpuUnavailableError` without CUDA.
    """
    if local_rank is None or local_size is None:
        lr, ls = local_position()
        local_rank = lr if local_rank is None else local_rank
        local_size = ls if local_size is None else local_size
    return devices.pin_gpu(local_rank, local_size)
