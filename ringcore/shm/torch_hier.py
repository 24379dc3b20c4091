"""The ``"ring"`` backend across hosts: each collective in two levels, one host's ranks
through its shared-memory group, the hosts over Gloo.

A :class:`Hierarchy` serves a group whose ranks run on several hosts with the same
number of ranks each, numbered host by host (rank ``r`` is local rank ``r % width`` of
host ``r // width``, as ``topology_from_hosts`` and torchrun number them). Each rank
holds its host's :class:`~ringcore.shm.group.ShmGroup` and a Gloo group of the ranks
with its local rank, one per host (``cross``). Every collective moves across the
network only what must cross it, and ``width`` ranks of a host share that traffic:

- **allreduce**: reduce-scatter in the host, allreduce of this rank's slice across the
  hosts, allgather in the host (as ``ringcore.shm.layer`` does for the engine);
- **reduce-scatter** (FSDP2's gradients): the rows reordered local rank first, a
  reduce-scatter in the host (each rank gets its column of every host's rows, summed in
  the host), then a reduce-scatter across the hosts;
- **all-gather** (FSDP2's parameters): an all-gather across the hosts, then in the host,
  the rows put back in rank order;
- **broadcast**: across the hosts among the root's local rank, then in each host from it.

- **barrier**: in the host, across the hosts among local rank 0, in the host again.

The ops run on one thread of the group (:class:`OpThread`), in the order they were
called, and the caller gets a work that completes when its op did: the cross-host half
waits on the network, and DDP's bucket allreduces overlap backward as they do on Gloo
(on one host an op is memory-bound work that backward would compete with, so it runs on
the calling thread there).

Average is a sum at both levels, divided by the group's size once (``finish_``, as the
shared-memory group divides). Gloo carries only some element types across the hosts:
:data:`CROSS_DTYPES` (not bool, whose Sum means "or" in the segment, nor int16 and the
complex types, which Gloo refuses or cannot all-gather); a ``RingProcessGroup`` gives
the others to its flat Gloo group, as on one host it gives what the segment lacks.
"""

from __future__ import annotations

import datetime
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._ops import ReduceOp
from .group import ShmGroup
from .layer import allreduce_two_levels
from .reduce import DTYPES, finish_

__all__ = ["CROSS_DTYPES", "Hierarchy", "OpThread"]

#: element types the hierarchical plan carries: the segment's, less those Gloo refuses
#: or cannot all-gather (int16, complex) or sums otherwise (bool: "or" in the segment)
CROSS_DTYPES: tuple[torch.dtype, ...] = tuple(
    d for d in DTYPES if d not in (torch.int16, torch.bool, torch.complex64, torch.complex128)
)

_TORCH_OPS = {
    ReduceOp.Sum: dist.ReduceOp(dist.ReduceOp.SUM),
    ReduceOp.Min: dist.ReduceOp(dist.ReduceOp.MIN),
    ReduceOp.Max: dist.ReduceOp(dist.ReduceOp.MAX),
    ReduceOp.Product: dist.ReduceOp(dist.ReduceOp.PRODUCT),
}


def _summed(op: ReduceOp) -> ReduceOp:
    """The operator of both levels: Average is a sum until the end."""
    return ReduceOp.Sum if op == ReduceOp.Average else op


@dataclass
class Hierarchy:
    """This rank's two levels: ``shm``, its host's group (``width`` ranks, this rank's
    index ``shm.local_rank``); ``cross``, the Gloo group of the ranks with its local rank
    (``hosts`` ranks, this rank's index ``host``); ``size = hosts * width``."""

    shm: ShmGroup
    cross: Any
    host: int
    hosts: int
    width: int

    @property
    def size(self) -> int:
        return self.hosts * self.width

    @property
    def local(self) -> int:
        return self.shm.local_rank

    def _cross_allreduce(self, t: torch.Tensor, op: ReduceOp) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = _TORCH_OPS[op]
        self.cross.allreduce([t], opts).wait()

    def allreduce_(self, flat: torch.Tensor, op: ReduceOp) -> None:
        """``flat`` (1-D, contiguous) reduced over every rank of the group, in place."""
        allreduce_two_levels(self.shm, flat, op, self._cross_allreduce, self.size)

    def gather_into(self, t: torch.Tensor, out: torch.Tensor) -> None:
        """Every rank's ``t`` into ``out`` (contiguous, ``size`` times its elements), in
        rank order."""
        n = t.numel()
        across = torch.empty(self.hosts * n, dtype=t.dtype)  # ranks (h, local) for each h
        self.cross._allgather_base(across, t.contiguous().view(-1)).wait()
        blocks = self.shm.allgather(across.view(1, -1))  # local rank by local rank
        out.view(self.hosts, self.width, n).copy_(
            blocks.view(self.width, self.hosts, n).transpose(0, 1)
        )

    def scatter_into(self, rows: torch.Tensor, out: torch.Tensor, op: ReduceOp) -> None:
        """Row ``rank`` of ``rows`` (``size`` rows) reduced over every rank, into ``out``
        (contiguous, one row's elements)."""
        base, n = _summed(op), out.numel()
        by_local = rows.reshape(self.hosts, self.width, n).transpose(0, 1).contiguous()
        mine = self.shm.reducescatter(by_local.view(self.width, self.hosts * n), base)
        opts = dist.ReduceScatterOptions()
        opts.reduceOp = _TORCH_OPS[base]
        self.cross._reduce_scatter_base(out.view(-1), mine.view(-1), opts).wait()
        finish_(out, op, self.size, 1.0)

    def broadcast_(self, t: torch.Tensor, root: int) -> None:
        """``t`` (contiguous) of rank ``root`` into every rank's ``t``."""
        host, local = divmod(root, self.width)
        if self.local == local:
            opts = dist.BroadcastOptions()
            opts.rootRank = host
            self.cross.broadcast([t], opts).wait()
        self.shm.broadcast_(t, local)

    def barrier(self) -> None:
        self.shm.barrier()
        if self.local == 0:
            self.cross.barrier(dist.BarrierOptions()).wait()
        self.shm.barrier()


_Work: Any = dist._Work  # torch's stubs do not type the Python-subclassable Work


class FutureWork(_Work):
    """A work that completes with ``fut``, and whose ``wait()`` raises what the op raised:
    torch's ``_create_work_from_future`` makes a work that reports success, and a future
    that holds nothing, when its future fails (torch 2.13) — a failed op would go unseen
    and its tensors be used as if reduced. ``wait``'s timeout is the op's own (the
    segment's rounds and Gloo's time out by themselves)."""

    def __init__(self, fut: torch.futures.Future) -> None:
        super().__init__()
        self._fut = fut

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        self._fut.wait()  # raises the op's error
        return True

    def get_future(self) -> torch.futures.Future:
        return self._fut

    def is_completed(self) -> bool:
        return self._fut.done()

    def result(self) -> list[torch.Tensor]:
        return self._fut.wait()


class OpThread:
    """One thread that runs a group's ops in the order :meth:`submit` was called (every
    rank calls them in the same order, so the ranks' threads meet in each op), started
    with the first op. An op that raises fails its own work; the ops after it still run."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._ops: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start = threading.Lock()

    def submit(self, fn: Callable[[], None], result: list[torch.Tensor]) -> Any:
        """A work whose future holds ``result`` once ``fn`` ran on the thread."""
        fut: torch.futures.Future = torch.futures.Future()
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
            self._ops.put((fn, result, fut))
        return FutureWork(fut)

    def _loop(self) -> None:
        while True:
            item = self._ops.get()
            if item is None:
                return
            fn, result, fut = item
            try:
                fn()
            except BaseException as exc:  # the caller's wait() raises it
                fut.set_exception(exc)
            else:
                fut.set_result(result)

    def close(self, timeout_s: float = 10.0) -> None:
        """Run what was submitted, then end the thread (waits up to ``timeout_s``)."""
        with self._start:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._ops.put(None)
            thread.join(timeout_s)
