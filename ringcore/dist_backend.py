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
- several hosts with the same number (> 1) of the group's ranks each, numbered host by
  host (as torchrun and ringcore's launchers number them): each op in two levels, the
  host's segment and Gloo across the hosts (``ringcore.shm.torch_hier``);
  ``RING_HIERARCHICAL_ALLREDUCE=0`` keeps such a group on Gloo, as it keeps the engine
  flat;
- any other layout of hosts (one rank per host, hosts of different sizes, ranks not
  numbered host by host), ``RING_SHM=0``, ``RING_TORCH_BACKEND=0`` (the off switch, for
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
from .shm.layer import Plan, hierarchical_wish, host_key, plan
from .shm.segment import SHM_ENV_VAR, shm_enabled
from .shm.torch_hier import Hierarchy
from .shm.torch_name import BACKEND_NAME, register_with
from .shm.torch_pg import RingProcessGroup

__all__ = ["BACKEND_NAME", "TORCH_BACKEND_ENV_VAR", "create_process_group", "register"]

log = logging.getLogger("ringtrain.ringcore.shm")

TORCH_BACKEND_ENV_VAR = cfg.TORCH_BACKEND_ENV_VAR


def _host_plan(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Plan:
    """The group's plan (``ringcore.shm.layer.plan``: "flat", "hierarchical" or "off",
    with why in words) from every rank's host, published through ``store``. Every rank of
    the group reaches the same plan (the same facts)."""
    if not cfg.get_bool(TORCH_BACKEND_ENV_VAR, True):
        return Plan("off", reason=f"{TORCH_BACKEND_ENV_VAR}=0")
    if not shm_enabled():
        return Plan("off", reason=f"{SHM_ENV_VAR}=0")
    if size == 1:
        return Plan("off", reason="one rank")
    store.set(f"ring-pg/host/{rank}", host_key())
    keys = [f"ring-pg/host/{r}" for r in range(size)]
    store.wait(keys, timeout)
    hosts = [store.get(k).decode() for k in keys]
    # each rank's place in its host, by rank: what topology_from_hosts would give it
    seen: dict[str, int] = {}
    places = []
    for h in hosts:
        places.append(seen.get(h, 0))
        seen[h] = places[-1] + 1
    facts = [(h, lr, seen[h]) for h, lr in zip(hosts, places)]
    return plan(rank, facts, shm=True, hierarchical=hierarchical_wish())


def _local_size_disagrees(size: int, here: int | None = None) -> str | None:
    """For the world's group: torchrun's ``LOCAL_WORLD_SIZE`` that says otherwise than
    the host check (ranks that share a boot id and host name but not ``/dev/shm``);
    ``here``: how many of the ranks report this host (None: all of them)."""
    world, local = os.environ.get("WORLD_SIZE"), os.environ.get("LOCAL_WORLD_SIZE")
    here = size if here is None else here
    if world is None or local is None or int(world) != size or int(local) == here:
        return None
    if here == size:
        return f"LOCAL_WORLD_SIZE={local} but the {size} ranks report one host"
    return f"LOCAL_WORLD_SIZE={local} but {here} of the {size} ranks report this host"


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
    the_plan = _host_plan(store, rank, size, timeout)
    reason = None if the_plan.mode != "off" else the_plan.reason
    world = opts.global_ranks_in_group in ([], list(range(size)))
    if the_plan.mode == "flat" and world:
        reason = _local_size_disagrees(size)
    # across hosts a host's veto reaches every rank through _join's agreement
    veto = (
        _local_size_disagrees(size, len(the_plan.local))
        if the_plan.mode == "hierarchical" and world
        else None
    )
    shm, hier = None, None
    if reason is None:
        shm, hier = _join(store, opts.group_id, gloo, the_plan, rank, timeout, veto)
        if shm is None:
            reason = veto or (
                "some host's shared-memory segment could not be set up (see the warning "
                "in that host's output)"
            )
    if rank == 0:
        log.info(
            "torch.distributed backend %r, group %s of %d ranks: %s",
            BACKEND_NAME,
            opts.group_id,
            size,
            "CPU collectives through shared memory"
            + (f", across hosts in two levels ({the_plan.reason})" if hier else "")
            if shm is not None
            else f"Gloo for every op: {reason}",
        )
    if reason is None:  # the flat plan says "every rank on one host"
        reason = (
            the_plan.reason
            if hier is None
            else f"hierarchical: {the_plan.reason}, the hosts over Gloo"
        )
    return RingProcessGroup(
        rank,
        size,
        gloo=gloo,
        shm=shm,
        cuda=_cuda_group(store, rank, size, timeout),
        hier=hier,
        reason=reason,
    )


def _join(
    store: Any,
    group_id: str,
    gloo: Any,
    the_plan: Plan,
    rank: int,
    timeout: datetime.timedelta,
    veto: str | None = None,
) -> tuple[ShmGroup | None, Hierarchy | None]:
    """This rank's host's segment, and across hosts its :class:`Hierarchy` (the Gloo group
    of the ranks with its local rank, made by every rank in the same call); (None, None)
    when some host could not set its segment up, or vetoed it (``veto``: why this host's
    ranks, which share their environment, do not use it), and then every rank agrees to
    use Gloo."""
    local = the_plan.local.index(rank)
    if veto is not None:
        if local == 0:
            log.warning("the ring backend keeps this group on Gloo: %s", veto)
        shm = None
    else:
        shm = ShmGroup.create(
            store,
            f"ring-pg/{group_id}/h{the_plan.host}",
            local,
            len(the_plan.local),
            timeout_s=timeout.total_seconds(),
            ranks=the_plan.local,
        )
    if the_plan.mode != "hierarchical":
        return shm, None
    try:  # a host without room keeps the whole group on Gloo
        ok = torch.tensor([int(shm is not None)], dtype=torch.int32)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
        gloo.allreduce([ok], opts).wait()
        if not int(ok.item()):
            if shm is not None:
                shm.close()
            return None, None
        width = len(the_plan.local)
        hosts = len(the_plan.cross[0])
        cross_store = dist.PrefixStore(f"ring-pg/cross/{local}/", store)
        cross = dist.ProcessGroupGloo(cross_store, the_plan.host, hosts, timeout)
    except BaseException:
        if shm is not None:
            shm.close()
        raise
    assert shm is not None
    return shm, Hierarchy(shm, cross, the_plan.host, hosts, width)


def register() -> None:
    """Make ``"ring"`` a ``torch.distributed`` backend (once per process)."""
    register_with(dist, create_process_group)


register()
