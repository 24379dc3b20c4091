"""Op execution: how the engine thread (or a caller in the fast lane) runs a response
item on the backend: a fused allreduce through one flat buffer (or straight through the
shared-memory segment), the other collectives one by one, a process-set change; with
the scale factors, Average's division, the neutral element of a joined rank, and the
timeline's phases. A part of :class:`~ringcore.engine.engine.Engine`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._errors import RingInternalError
from .._ops import OpKind, ReduceOp
from ..backends.devices import device_of_type
from ..backends.protocol import Backend
from .handle import Handle, InputHandle
from .protocol import Entry, ResponseItem
from .reduction import adasum_, average_, neutral_fill, scale_
from .timeline import Timeline

__all__ = ["SLOT_FUSION_MAX", "Execution"]

#: a fused allreduce of up to this many tensors goes straight into the shared-memory
#: segment (one copy per tensor each way); more are flattened first (one C call)
SLOT_FUSION_MAX = 64

_PS_ADD, _ADASUM, _AVERAGE = OpKind.PS_ADD, ReduceOp.Adasum, ReduceOp.Average
_COLLECTIVE_PHASE = {
    OpKind.ALLREDUCE: "ALLREDUCE",
    OpKind.ALLGATHER: "ALLGATHER",
    OpKind.BROADCAST: "BROADCAST",
    OpKind.ALLTOALL: "ALLTOALL",
    OpKind.REDUCESCATTER: "REDUCESCATTER",
    OpKind.BARRIER: "BARRIER",
}


def _flatten(bufs: list[torch.Tensor]) -> torch.Tensor:
    """``bufs`` (one dtype and device) copied into one new flat buffer, in order. Flat
    tensors (biases, a burst of vectors) are concatenated as they are: measured for
    1,000 tensors of 4 KB, ``torch.cat`` takes 0.24 ms where ``flatten_dense_tensors``
    (a flat view of each first) takes 1.2 ms."""
    if all(b.dim() == 1 for b in bufs):
        return torch.cat(bufs)
    if all(b.is_contiguous() for b in bufs):
        return torch._C._nn.flatten_dense_tensors(bufs)
    return torch.cat([b.reshape(-1) for b in bufs])


def _unflatten(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like each of ``like``, in order (no copies); for flat
    tensors one ``split`` (0.35 ms for 1,000, against 1.1 ms for the general form)."""
    if all(t.dim() == 1 for t in like):
        return list(flat.split_with_sizes([t.shape[0] for t in like]))
    return torch._C._nn.unflatten_dense_tensors(flat, like)


class Execution:
    """The op execution of :class:`~ringcore.engine.engine.Engine`: what it reads of the
    engine's state (set up in ``Engine.__init__``) and of its other parts."""

    backend: Backend
    rank: int
    size: int
    timeline: Timeline
    stats: dict[str, int]
    groups: dict[int, Any]
    members: dict[int, list[int]]
    _t_resp: float
    _kind: OpKind
    _take: Callable[[int, str], Handle | None]

    def _runners(self) -> dict[OpKind, Callable[[ResponseItem, list[Handle | None]], None]]:
        """How each kind of response item runs (the receive loop looks it up per item)."""
        return {
            OpKind.ALLREDUCE: self._run_allreduce,
            OpKind.ALLGATHER: self._run_allgather,
            OpKind.BROADCAST: self._run_broadcast,
            OpKind.ALLTOALL: self._run_alltoall,
            OpKind.REDUCESCATTER: self._run_reducescatter,
            OpKind.BARRIER: self._run_barrier,
        }

    def _finish(self, h: Handle, value: Any) -> None:
        try:
            h.resolve(h.output(value))
        except Exception as exc:
            h.resolve(error=exc)

    def _span(self, h: Handle | None, name: str, phase: str, start: float, end: float) -> None:
        """One timeline phase on the row ``<kind>.<name>`` (Horovod's tensor name);
        QUEUE also records the NEGOTIATE_<KIND> phase before it."""
        if self.timeline.active:
            kind = self._kind
            row = name if name.startswith(f"{kind}.") else f"{kind}.{name}"
            if phase == "QUEUE":
                if h is not None:
                    negotiate = f"NEGOTIATE_{_COLLECTIVE_PHASE.get(kind, kind.upper())}"
                    self.timeline.span(row, negotiate, h.submitted, self._t_resp)
                start = self._t_resp
            self.timeline.span(row, phase, start, end)

    # -- the ops ------------------------------------------------------------------
    def _neutral(
        self, entry: Entry, dtype: torch.dtype, op: int, dev: str | None = None
    ) -> torch.Tensor:
        """A joined rank's contribution to ``entry``: the neutral element of ``op``."""
        return torch.full(
            entry.shape, neutral_fill(dtype, op), dtype=dtype, device=device_of_type(dev)
        )

    def _reduce(self, x: torch.Tensor, item: ResponseItem, op: ReduceOp, group: Any) -> None:
        """The reduction every reducing op shares (allreduce, reducescatter): prescale,
        the backend's allreduce, Average's division by the set's size, postscale."""
        scale_(x, item.prescale)
        self.backend.allreduce(x, op, group)
        if op == _AVERAGE:
            average_(x, len(self.members[item.process_set]))
        scale_(x, item.postscale)

    def _run_allreduce(self, item: ResponseItem, handles: list[Handle | None]) -> None:
        t_start = time.perf_counter()
        op, group = ReduceOp(item.op), self.groups[item.process_set]
        dtype = getattr(torch, item.dtype)
        bufs: list[torch.Tensor] = [
            h.tensor
            if h is not None and h.tensor is not None
            else self._neutral(e, dtype, op, item.device)
            for h, e in zip(handles, item.entries)
        ]
        for h, e in zip(handles, item.entries) if self.timeline.active else ():
            self._span(h, e.name, "QUEUE", h.submitted if h else t_start, t_start)
        self._allreduce_bufs(item, handles, bufs, op, group, t_start)

    def _allreduce_bufs(
        self,
        item: ResponseItem,
        handles: Sequence[Handle | None],
        bufs: list[torch.Tensor],
        op: ReduceOp,
        group: Any = None,
        t_start: float = 0.0,
    ) -> None:
        """Allreduce ``bufs`` (one per handle: its tensor, or a joined rank's neutral
        element) and finish the handles; the fast lane calls it with ``item.entries``
        empty (they only name timeline rows)."""
        inputs = [type(h) is InputHandle for h in handles]
        if op == _ADASUM or (len(bufs) == 1 and inputs[0]):
            # reduced where they are: a caller's input is copied first
            bufs = [b.clone() if keep else b for b, keep in zip(bufs, inputs)]
            inputs = [False] * len(bufs)
        if op == _ADASUM:
            self._run_adasum(item, handles, bufs, group)
        else:
            bufs = self._run_fused(item, handles, bufs, inputs, op, group, t_start)
        for h, b in zip(handles, bufs):
            if h is not None:
                self._finish(h, b)

    def _run_adasum(
        self,
        item: ResponseItem,
        handles: Sequence[Handle | None],
        bufs: list[torch.Tensor],
        group: Any,
    ) -> None:
        for buf, h, e in zip(bufs, handles, item.entries):
            t0 = time.perf_counter()
            scale_(buf, item.prescale)
            adasum_(buf, self.members[item.process_set], self.rank, self.backend, group)
            scale_(buf, item.postscale)
            self._span(h, e.name, "ADASUM", t0, time.perf_counter())

    def _run_fused(
        self,
        item: ResponseItem,
        handles: Sequence[Handle | None],
        bufs: list[torch.Tensor],
        inputs: list[bool],
        op: ReduceOp,
        group: Any,
        t_start: float,
    ) -> list[torch.Tensor]:
        """Allreduce ``bufs`` through one flat buffer (the tensor itself when alone);
        the results: ``bufs``, but a new tensor for each of ``inputs`` (a caller's input,
        left as it is; never alone). A backend with ``allreduce_list`` (the shared-memory
        plane) takes up to ``SLOT_FUSION_MAX`` of them straight into its segment: no flat
        copy in or out."""
        lister = getattr(self.backend, "allreduce_list", None)
        if (
            lister is not None
            and 1 < len(bufs) <= SLOT_FUSION_MAX
            and all(b.dtype == bufs[0].dtype for b in bufs)  # a group may mix dtypes
        ):
            srcs = [b if b.is_contiguous() else b.contiguous() for b in bufs]
            dsts = [torch.empty_like(x) if keep else x for x, keep in zip(srcs, inputs)]
            if lister(srcs, dsts, op, item.prescale, item.postscale, group):
                self.stats["ops_fused"] += len(bufs)
                self.stats["ops_in_slot"] += len(bufs)
                t2 = time.perf_counter()
                for h, e in zip(handles, item.entries) if self.timeline.active else ():
                    self._span(h, e.name, "ALLREDUCE", t_start, t2)
                out = []
                for b, x, d, keep in zip(bufs, srcs, dsts, inputs):
                    if not keep and x is not b:
                        b.copy_(d)  # a non-contiguous tensor: reduced in a copy
                    out.append(d if keep else b)
                return out
        if len(bufs) == 1:
            flat, t1 = bufs[0].view(-1), time.perf_counter()
        else:
            flat = _flatten(bufs)  # one copy into the fusion buffer, no view per tensor
            self.stats["ops_fused"] += len(bufs)
            t1 = time.perf_counter()
            for h, e in zip(handles, item.entries) if self.timeline.active else ():
                self._span(h, e.name, "MEMCPY_IN_FUSION_BUFFER", t_start, t1)
        self._reduce(flat, item, op, group)
        t2 = time.perf_counter()
        for h, e in zip(handles, item.entries) if self.timeline.active else ():
            self._span(h, e.name, "ALLREDUCE", t1, t2)
        if len(bufs) > 1:
            views = _unflatten(flat, bufs)
            if not any(inputs):
                torch._foreach_copy_(bufs, views)
            else:  # one call each way: new tensors for the inputs, copies for the rest
                outs = torch._foreach_clone([v for v, keep in zip(views, inputs) if keep])
                into = [(b, v) for b, v, keep in zip(bufs, views, inputs) if not keep]
                if into:
                    torch._foreach_copy_([b for b, _ in into], [v for _, v in into])
                fresh = iter(outs)
                bufs = [next(fresh) if keep else b for b, keep in zip(bufs, inputs)]
            t3 = time.perf_counter()
            for h, e in zip(handles, item.entries) if self.timeline.active else ():
                self._span(h, e.name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3)
        return bufs

    def _run_allgather(self, item: ResponseItem, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item.entries
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e.name, "QUEUE", h.submitted, t0)
        out = self.backend.allgather(h.tensor, list(item.dims), self.groups[item.process_set])
        self._span(h, e.name, "ALLGATHER", t0, time.perf_counter())
        self._finish(h, out)

    def _run_broadcast(self, item: ResponseItem, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item.entries
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e.name, "QUEUE", h.submitted, t0)
        ps = item.process_set
        self.backend.broadcast(h.tensor, item.root, self.members[ps], self.groups[ps])
        self._span(h, e.name, "BROADCAST", t0, time.perf_counter())
        self._finish(h, h.tensor)

    def _run_alltoall(self, item: ResponseItem, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item.entries
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e.name, "QUEUE", h.submitted, t0)
        members = self.members[item.process_set]
        me = members.index(self.rank)
        send = list(item.splits[me])
        recv = [row[me] for row in item.splits]
        out = self.backend.alltoall(h.tensor, send, recv, self.groups[item.process_set])
        self._span(h, e.name, "ALLTOALL", t0, time.perf_counter())
        self._finish(h, (out, torch.tensor(recv, dtype=torch.int64)))

    def _run_reducescatter(self, item: ResponseItem, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item.entries
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e.name, "QUEUE", h.submitted, t0)
        members = self.members[item.process_set]
        n, me = len(members), members.index(self.rank)
        x = h.tensor
        base, extra = divmod(x.shape[0], n)
        self._reduce(x, item, ReduceOp(item.op), self.groups[item.process_set])
        start = me * base + min(me, extra)
        out = x[start : start + base + (1 if me < extra else 0)].clone()
        self._span(h, e.name, "REDUCESCATTER", t0, time.perf_counter())
        self._finish(h, out)

    def _run_barrier(self, item: ResponseItem, handles: list[Handle | None]) -> None:
        self.backend.barrier(self.groups[item.process_set])
        for h in handles:
            if h is not None:
                self._finish(h, None)

    def _process_set_change(self, item: ResponseItem) -> None:
        handle = self._take(0, item.entries[0].name)
        try:
            if item.kind == _PS_ADD:
                ranks = list(item.ranks)
                if item.set_id not in self.groups:
                    # every rank creates every group, in the coordinator's order
                    self.groups[item.set_id] = self.backend.new_group(ranks, self.size)
                    self.members[item.set_id] = ranks
                result: Any = item.set_id
            else:
                self.groups.pop(item.set_id, None)
                self.members.pop(item.set_id, None)
                result = None
        except Exception as exc:
            if handle is not None:
                handle.resolve(error=RingInternalError(f"process set change failed: {exc}"))
            return
        if handle is not None:
            handle.resolve(result)
