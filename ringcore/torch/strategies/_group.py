"""The job's torch process group, for the strategies that run on torch's own collectives."""

from __future__ import annotations

from typing import Any


def ensure_process_group() -> Any:
    """``torch.distributed`` with the job's default group formed: the group ringcore
    formed (or adopted) at ``ringcore.init()``, else one formed now from the launcher's
    torchrun variables (Gloo, with NCCL for CUDA tensors when this rank has a GPU)."""
    import torch
    import torch.distributed as dist

    from ... import torch as hvd

    if not hvd.is_initialized():
        hvd.init()
    if not dist.is_initialized():
        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
    return dist


def device_of(module: Any) -> Any:
    """Where ``module``'s parameters live (CPU for a module with none)."""
    import torch

    for p in module.parameters():
        return p.device
    return torch.device("cpu")
