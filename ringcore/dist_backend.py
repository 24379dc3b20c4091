"""``import ringcore.dist_backend``: the ``torch.distributed`` backend ``"ring"``.

After the import, ``dist.init_process_group(backend="ring")`` (or
``"cpu:ring,cuda:nccl"``) forms a group whose CPU collectives between the ranks of one
host go through ringcore's shared-memory data plane instead of loopback Gloo; DDP and
FSDP2 then move their gradients and parameters through it unchanged. What it does not
carry goes to a Gloo group it holds over the same store
(:class:`~ringcore.shm.torch_pg.RingProcessGroup` says which op goes where), so a
program runs on ``"ring"`` wherever it runs on ``"gloo"``:

- every rank of the group on one host (the same boot id and host name, published
  through the group's store; ``LOCAL_WORLD_SIZE``, when torchrun set it, must agree):
  shared memory;
- ranks on several hosts, ``RING_SHM=0``, ``RING_TORCH_BACKEND=0`` (the off switch, for
  ringcore's own use too), a host whose ``/dev/shm`` is too small, or one rank: Gloo for
  every op. Rank 0 logs which, and why, on the ``ringtrain.ringcore.shm`` logger.

Registering is the import's one effect (torch's plugin pattern: the backend must be
known before ``init_process_group`` names it); :func:`register` is idempotent. Importing
this module loads torch, never pyspark or ray.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from . import _config as cfg
from .shm.group import ShmGroup
from .shm.layer import host_key
from .shm.segment import SHM_ENV_VAR, shm_enabled
from .shm.torch_pg import BACKEND_NAME, RingProcessGroup

__all__ = ["BACKEND_NAME", "TORCH_BACKEND_ENV_VAR", "create_process_group", "register"]

log = logging.getLogger("ringtrain.ringcore.shm")

TORCH_BACKEND_ENV_VAR = cfg.TORCH_BACKEND_ENV_VAR


def _host_plan(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> str | None:
    """None when the group's ranks share this host; else why they use Gloo, in words.
    Every rank of the group reaches the same answer (the same facts, through ``store``)."""
    if not cfg.get_bool(TORCH_BACKEND_ENV_VAR, True):
        return f"{TORCH_BACKEND_ENV_VAR}=0"
    if not shm_enabled():
        return f"{SHM_ENV_VAR}=0"
    if size == 1:
        return "one rank"
    store.set(f"ring-pg/host/{rank}", host_key())
    keys = [f"ring-pg/host/{r}" for r in range(size)]
    store.wait(keys, timeout)
    hosts = {store.get(k) for k in keys}
    if len(hosts) > 1:
        return f"its {size} ranks are on {len(hosts)} hosts (no hierarchical plan yet)"
    return None


def _local_size_disagrees(size: int) -> str | None:
    """For the world's group: torchrun's ``LOCAL_WORLD_SIZE`` that says otherwise than
    the host check (ranks that share a boot id and host name but not ``/dev/shm``)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    if world is None or local is None or int(world) != size or int(local) == size:
        return None
    return f"LOCAL_WORLD_SIZE={local} but the {size} ranks report one host"


def _cuda_group(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
    """NCCL's group for CUDA tensors, when torch has NCCL and this process sees a GPU."""
    if not (torch.cuda.is_available() and dist.is_nccl_available()):
        return None
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(dist.PrefixStore("nccl/", store), rank, size, options)


def create_process_group(opts: Any, pg_options: Any = None) -> RingProcessGroup:
    """torch's creator of the backend (``extended_api``): called on every rank of a new
    group with its store (prefixed by torch for this group), rank, size and timeout."""
    store, rank, size = opts.store, opts.group_rank, opts.group_size
    timeout = opts.timeout
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", store), rank, size, timeout)
    reason = _host_plan(store, rank, size, timeout)
    if reason is None and (opts.global_ranks_in_group in ([], list(range(size)))):
        reason = _local_size_disagrees(size)
    shm = None
    if reason is None:
        shm = ShmGroup.create(
            store, f"ring-pg/{opts.group_id}", rank, size, timeout_s=timeout.total_seconds()
        )
        if shm is None:
            reason = "the shared-memory segment could not be set up (see the warning above)"
    if rank == 0:
        log.info(
            "torch.distributed backend %r, group %s of %d ranks: %s",
            BACKEND_NAME,
            opts.group_id,
            size,
            "CPU collectives through shared memory"
            if shm is not None
            else f"Gloo for every op: {reason}",
        )
    return RingProcessGroup(
        rank,
        size,
        gloo=gloo,
        shm=shm,
        cuda=_cuda_group(store, rank, size, timeout),
        reason=reason or "every rank on one host",
    )


def register() -> None:
    """Make ``"ring"`` a ``torch.distributed`` backend (once per process)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, create_process_group, extended_api=True, devices=["cpu"]
    )


register()
