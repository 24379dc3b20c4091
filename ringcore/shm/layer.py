"""The shared-memory data plane as a layer in front of any backend, and hierarchical
allreduce.

:func:`join` runs right after a backend's factory connected (``ringcore.runtime``
calls it for whichever backend ``RING_BACKEND`` named, when the connection came with
the ring's store and key prefix), on every rank, in the same order. It learns which
ranks share a machine (each rank's host name and boot id, through the ring's store),
decides a :class:`Plan` (the same one on every rank: it is computed from the same
facts) and returns a :class:`ShmBackend` wrapping the network backend:

- **flat** — every rank on one host: CPU tensors of the whole-world group go through
  one :class:`~ringcore.shm.group.ShmGroup` (allreduce with every operator, allgather with
  uneven first dimensions, broadcast, alltoall with splits, barrier).
- **hierarchical** — several hosts with the same number (> 1) of ranks each, numbered
  host by host (as ``topology_from_hosts`` numbers them): an allreduce is a
  reduce-scatter inside the host through shared memory, an allreduce of each local
  rank's slice across the hosts over a Gloo group of the ranks with that local rank,
  and an allgather inside the host; the cross-host groups are the wrapped backend's
  (``new_group``). Other collectives take the network path.
  ``RING_HIERARCHICAL_ALLREDUCE=0`` turns it off, ``=1`` asks for it (a warning says
  why when the topology does not allow it); unset, it is on where allowed.
- **off** — ``RING_SHM=0``, one rank per host, hosts of different sizes without
  hierarchy, or a topology the hosts contradict: the wrapped backend does everything.
  A connection without a store of the job (MPI's own world, a ``torch.distributed``
  group someone else formed) never gets here: its backend does everything too.

CUDA tensors, process-set subgroups and element types the group does not carry always
take the wrapped backend. Every rank routes an op by facts the coordinator has made
equal on every rank (group, device type, dtype, number of dimensions), never by its
own tensor's layout, so the ranks never split between the two paths. When ``/dev/shm``
is too small on some host, or a local rank there cannot open, check or map the
segment (another user's file, ranks in containers that do not share ``/dev/shm``), one
rank of that host logs the group's one warning and every rank keeps the network path
(the ranks agree through one small allreduce of the wrapped backend at start).

``stats`` counts the ops each path carried; ``mode`` names the plan (tests and
``bench/`` read both). ``name`` stays the wrapped backend's (``gloo_enabled()``).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .. import _config as cfg
from .._errors import RendezvousError
from .._ops import ReduceOp
from ..backends.protocol import Backend
from ..rendezvous.topology import Topology
from .group import DEFAULT_SLOT_BYTES, ShmGroup
from .reduce import DTYPES, finish_
from .segment import SHM_ENV_VAR, shm_enabled

__all__ = [
    "HIERARCHICAL_ENV_VAR",
    "Plan",
    "ShmBackend",
    "allreduce_two_levels",
    "hierarchical_wish",
    "host_key",
    "join",
    "plan",
]

log = logging.getLogger("ringtrain.ringcore.shm")

# "0": never; "1": wanted (warn when impossible); unset: where the topology allows.
# HOROVOD_HIERARCHICAL_ALLREDUCE is read too (``_config.get_env``).
HIERARCHICAL_ENV_VAR = "RING_HIERARCHICAL_ALLREDUCE"

_SHM_OPS = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


@dataclass(frozen=True)
class Plan:
    """What the shared-memory data plane does on this rank. ``local``: the global ranks
    of this rank's host in local-rank order; ``host``: the host's index (order of first
    appearance); ``cross``: per local rank, the ranks with that local rank (hierarchical
    only); ``reason``: why this mode, in words."""

    mode: str  # "off", "flat" or "hierarchical"
    local: tuple[int, ...] = ()
    host: int = 0
    cross: tuple[tuple[int, ...], ...] = ()
    reason: str = ""


def host_key() -> str:
    """Which machine this process runs on: its boot id (two machines never share one)
    and its host name as the launcher gave it (``RING_HOSTNAME``) or the system's."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{boot}/{os.environ.get(cfg.HOSTNAME_ENV_VAR) or socket.gethostname()}"


def hierarchical_wish() -> bool | None:
    raw = cfg.get_env(HIERARCHICAL_ENV_VAR)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().lower()
    if value not in ("0", "1", "true", "false", "yes", "no", "on", "off"):
        raise ValueError(
            f"{HIERARCHICAL_ENV_VAR}={raw!r} is not 0 or 1; set 1 to use hierarchical "
            "allreduce, 0 for the flat ring, or unset it to let the topology decide."
        )
    return value in ("1", "true", "yes", "on")


def plan(
    rank: int, facts: list[tuple[str, int, int]], *, shm: bool, hierarchical: bool | None
) -> Plan:
    """The plan of ``rank`` from every rank's ``(host key, local_rank, local_size)``.

    Pure: every rank computes the same plan from the same ``facts``."""
    size = len(facts)
    hosts: dict[str, list[int]] = {}
    for r, (key, _, _) in enumerate(facts):
        hosts.setdefault(key, []).append(r)
    groups = list(hosts.values())
    host = next(i for i, g in enumerate(groups) if rank in g)
    local = tuple(groups[host])
    if not shm:
        return Plan("off", local, host, reason="RING_SHM=0")
    for g in groups:
        if any(facts[r][1:] != (i, len(g)) for i, r in enumerate(g)):
            r = next(r for i, r in enumerate(g) if facts[r][1:] != (i, len(g)))
            return Plan(
                "off",
                local,
                host,
                reason=f"rank {r} says local rank {facts[r][1]} of {facts[r][2]}, but its "
                f"host runs ranks {g}",
            )
    if size == 1 or all(len(g) == 1 for g in groups):
        return Plan("off", local, host, reason="one rank per host")
    if len(groups) == 1:
        return Plan("flat", local, host, reason="every rank on one host")
    width = len(groups[0])
    why_not = None
    if hierarchical is False:
        why_not = f"{HIERARCHICAL_ENV_VAR}=0"
    elif any(len(g) != width for g in groups):
        why_not = f"hosts run different numbers of ranks ({[len(g) for g in groups]})"
    elif any(g != list(range(h * width, (h + 1) * width)) for h, g in enumerate(groups)):
        why_not = "ranks are not numbered host by host"
    if why_not is not None:
        return Plan("off", local, host, reason=f"several hosts, no hierarchy: {why_not}")
    cross = tuple(tuple(h * width + lr for h in range(len(groups))) for lr in range(width))
    return Plan("hierarchical", local, host, cross, f"{len(groups)} hosts x {width} ranks")


def allreduce_two_levels(
    shm: ShmGroup,
    flat: torch.Tensor,
    op: ReduceOp,
    across: Callable[[torch.Tensor, ReduceOp], None],
    size: int,
) -> None:
    """``flat`` (1-D, contiguous) reduced over every host, in place: a reduce-scatter in
    the host (``shm``), ``across(slice, op)`` (an allreduce of this rank's slice among the
    ranks with its local rank), an all-gather in the host. Average is a sum at both levels,
    divided by ``size`` (the ranks of every host) once, as the segment divides. The
    engine's :class:`ShmBackend` and the ``"ring"`` backend's ``Hierarchy`` both run it."""
    base = ReduceOp.Sum if op == ReduceOp.Average else op
    part = shm.reducescatter(flat, base)
    if part.numel():  # the same on every rank of the cross group (the same split)
        across(part, base)
        finish_(part, op, size, 1.0)
    if flat.numel() % shm.local_size == 0:  # every rank's slice alike: straight into flat
        shm.allgather(part, out=flat)
    else:
        flat.copy_(shm.allgather(part))


def _gather_facts(store: Any, topo: Topology, timeout_s: float) -> list[tuple[str, int, int]]:
    """Every rank's ``(host key, local_rank, local_size)``, through ``store``."""
    mine = [host_key(), topo.local_rank, topo.local_size]
    store.set(f"shm-plan/{topo.rank}", json.dumps(mine))
    keys = [f"shm-plan/{r}" for r in range(topo.size)]
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError is one
        missing = [r for r, k in enumerate(keys) if not store.check([k])]
        raise RendezvousError(
            f"rank {topo.rank}: ranks {missing} did not publish their host within "
            f"{timeout_s:.0f} s while the shared-memory data plane was set up; check "
            f"those ranks' output, or set {SHM_ENV_VAR}=0."
        ) from exc
    out = []
    for k in keys:
        key, lr, ls = json.loads(store.get(k))
        out.append((str(key), int(lr), int(ls)))
    return out


def join(inner: Backend, store: Any, prefix: str, topo: Topology, timeout_s: float) -> Backend:
    """``inner`` wrapped in a :class:`ShmBackend` when the plan uses shared memory, else
    ``inner`` itself. Every rank calls it once per ring, in the same place; ``store``:
    the ring's (prefixed) store, ``prefix``: the ring's key prefix (names the segment)."""
    if topo.size == 1:
        return inner
    the_plan = plan(
        topo.rank,
        _gather_facts(store, topo, timeout_s),
        shm=shm_enabled(),
        hierarchical=hierarchical_wish(),
    )
    if hierarchical_wish() and the_plan.mode == "off" and topo.rank == 0:
        log.warning("%s=1 but the allreduce stays flat: %s.", HIERARCHICAL_ENV_VAR, the_plan.reason)
    log.debug("shared-memory data plane: %s (%s)", the_plan.mode, the_plan.reason)
    if the_plan.mode == "off":
        return inner
    cross = None
    if the_plan.mode == "hierarchical":  # every rank makes every group, in one order
        for ranks in the_plan.cross:
            g = inner.new_group(list(ranks), topo.size)
            if topo.rank in ranks:
                cross = g
    group = ShmGroup.create(
        store,
        f"{prefix}/h{the_plan.host}",
        the_plan.local.index(topo.rank),
        len(the_plan.local),
        timeout_s=timeout_s,
        slot_bytes=ShmBackend.slot_bytes,
        ranks=the_plan.local,
    )
    try:
        # every rank must agree: a host without room keeps the whole job on the network
        ok = torch.tensor([0 if group is None else 1], dtype=torch.int32)
        inner.allreduce(ok, ReduceOp.Min, None)
    except BaseException:
        if group is not None:
            group.close()
        raise
    if not int(ok.item()):
        if group is not None:
            group.close()
        return inner
    assert group is not None  # every rank agreed it holds one
    return ShmBackend(inner, group, the_plan, cross)


class ShmBackend:
    """``inner`` (the network backend) with the whole-world CPU collectives of this
    host's ranks (flat) or the allreduce across hosts (hierarchical) done through
    ``shm``. Called from the engine's thread only. ``slot_bytes``: the group's slot
    size (a seam: tests shrink it so that small tensors span several chunks)."""

    slot_bytes = DEFAULT_SLOT_BYTES

    def __init__(self, inner: Backend, shm: ShmGroup, plan_: Plan, cross_group: Any = None) -> None:
        self.inner = inner
        self.name = inner.name
        self.shm = shm
        self.plan = plan_
        self.mode = plan_.mode
        self.cross_group = cross_group
        self.stats = {"shm": 0, "hierarchical": 0, "network": 0}

    # ---- routing ------------------------------------------------------------------------

    def _ours(self, t: torch.Tensor, group: Any, *, flat_only: bool = True) -> bool:
        """Whether ``t``'s op takes the shared-memory path: facts equal on every rank only."""
        if group is not None or t.device.type != "cpu" or t.dtype not in DTYPES:
            return False
        return self.mode == "flat" or (not flat_only and self.mode == "hierarchical")

    def _network(self) -> Any:
        self.stats["network"] += 1
        return self.inner

    # ---- the Backend protocol -----------------------------------------------------------

    def allreduce(self, t: torch.Tensor, op: ReduceOp, group: Any) -> None:
        if op not in _SHM_OPS or not self._ours(t, group, flat_only=False):
            return self._network().allreduce(t, op, group)
        # Average: the engine divides by the set's size after the backend's sum
        shm_op = ReduceOp.Sum if op == ReduceOp.Average else op
        x = t if t.is_contiguous() else t.contiguous()
        if self.mode == "flat":
            self.stats["shm"] += 1
            self.shm.allreduce_(x, shm_op)
        else:
            self.stats["hierarchical"] += 1
            self._hierarchical(x.view(-1), shm_op)
        if x is not t:
            t.copy_(x)
        return None

    def allreduce_list(
        self,
        srcs: list[torch.Tensor],
        dsts: list[torch.Tensor],
        op: ReduceOp,
        prescale: float,
        postscale: float,
        group: Any,
    ) -> bool:
        """A fused allreduce of the whole world (``srcs`` -> ``dsts``, contiguous, one
        dtype) through the segment's slot as the fusion buffer, with the prescale, the
        Average division and the postscale done there too; False: not ours (the engine
        flattens and calls :meth:`allreduce`). Decided by facts equal on every rank."""
        if self.mode != "flat" or op not in _SHM_OPS or not self._ours(srcs[0], group):
            return False
        self.stats["shm"] += 1
        self.shm.allreduce_list_(srcs, dsts, op, prescale, postscale)
        return True

    def _hierarchical(self, flat: torch.Tensor, op: ReduceOp) -> None:
        """Reduce-scatter in the host, allreduce of this rank's slice across the hosts
        (the ranks with this local rank), allgather in the host (``op`` is never Average
        here: the engine divides after the backend's sum)."""

        def across(part: torch.Tensor, o: ReduceOp) -> None:
            self.inner.allreduce(part, o, self.cross_group)

        size = self.shm.local_size * len(self.plan.cross[0])
        allreduce_two_levels(self.shm, flat, op, across, size)

    def allgather(self, t: torch.Tensor, dims: list[int], group: Any) -> torch.Tensor:
        if t.dim() == 0 or not self._ours(t, group):
            return self._network().allgather(t, dims, group)
        self.stats["shm"] += 1
        return self.shm.allgather(t.contiguous())

    def broadcast(self, t: torch.Tensor, root: int, members: list[int], group: Any) -> None:
        if not self._ours(t, group):
            return self._network().broadcast(t, root, members, group)
        self.stats["shm"] += 1
        x = t if t.is_contiguous() else t.contiguous()
        self.shm.broadcast_(x, self.plan.local.index(root))
        if x is not t:
            t.copy_(x)
        return None

    def alltoall(
        self, t: torch.Tensor, send: list[int], recv: list[int], group: Any
    ) -> torch.Tensor:
        if t.dim() == 0 or not self._ours(t, group):
            return self._network().alltoall(t, send, recv, group)
        self.stats["shm"] += 1
        out, _ = self.shm.alltoall(t.contiguous(), send)
        return out

    def barrier(self, group: Any) -> None:
        if group is not None or self.mode != "flat":
            return self._network().barrier(group)
        self.stats["shm"] += 1
        self.shm.barrier()
        return None

    def exchange(self, send: torch.Tensor, recv: torch.Tensor, peer: int, group: Any) -> None:
        return self.inner.exchange(send, recv, peer, group)

    def new_group(self, ranks: list[int], size: int) -> Any:
        return self.inner.new_group(ranks, size)

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.inner.broadcast_object(obj, root)

    def close(self) -> None:
        self.shm.close()
