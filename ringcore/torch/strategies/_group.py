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


#: the group of the backend "ring" the strategies made, and the default group it was
#: made beside (a process that runs several jobs makes one per job)
_ring: list[Any] = []


def strategy_group(device: Any) -> Any:
    """The group the ``ddp`` and ``fsdp`` strategies run on; None: the job's default group.

    For a model on the CPU, in a job of several ranks: a group of the
    ``torch.distributed`` backend ``"ring"`` over every rank (``ringcore.dist_backend``),
    whose CPU collectives between the ranks of one host go through ringcore's
    shared-memory plane, across hosts of the same size in two levels (the host's plane,
    Gloo between the hosts), and through Gloo otherwise (other layouts of hosts, ops it
    does not carry). Made once per job: ``new_group`` is collective, and every rank's strategy
    asks for it at the same point of ``prepare``. ``RING_TORCH_BACKEND=0``, a CUDA model
    (NCCL is the default group's) or one rank: None."""
    import torch.distributed as dist

    from ... import _config as cfg

    if (
        device.type != "cpu"
        or dist.get_world_size() == 1
        or not cfg.get_bool(cfg.TORCH_BACKEND_ENV_VAR, True)
    ):
        return None
    world = dist.group.WORLD
    if _ring and _ring[0] is world:
        return _ring[1]
    from ... import dist_backend  # registers the backend

    group = dist.new_group(backend=dist_backend.BACKEND_NAME, timeout=cfg.group_timeout())
    _ring[:] = [world, group]
    return group


def device_of(module: Any) -> Any:
    """Where ``module``'s parameters live (CPU for a module with none)."""
    import torch

    for p in module.parameters():
        return p.device
    return torch.device("cpu")
