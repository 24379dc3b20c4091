"""Negotiation: how the coordinator decides which named ops every rank runs, and in
what order (a part of :class:`~ringcore.engine.coordinator.Coordinator`).

A request is filed under (process set, name) with the ranks that sent it; once every
member rank has (joined ranks count for allreduces, lost ones fail it), the requests
are checked to agree (by their cache id alone, else field by field), and the ready ops
become response items in submission order: allreduces fused up to the threshold
(``fusion``), a cache id for every new name, bare ids once every rank has seen one.
The stall inspector warns about, and finally fails, names some ranks never sent.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .._ops import CONTROL_KINDS, OpKind
from .fusion import Fusion, FusionBuckets, nbytes
from .messages import Message, ResponseBatch
from .protocol import CachedId, CachedRequest, Entry, Request, ResponseItem, disagreement

__all__ = ["Negotiation", "left_the_job"]

log = logging.getLogger("ringtrain.ringcore.coordinator")

_ALLREDUCE, _ALLGATHER, _ALLTOALL = OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.ALLTOALL
_PS_ADD, _PS_REMOVE = OpKind.PS_ADD, OpKind.PS_REMOVE
_REDUCESCATTER, _JOIN, _ERROR = OpKind.REDUCESCATTER, OpKind.JOIN, OpKind.ERROR


@dataclass
class Pending:
    """One named op being negotiated: each rank's request, since when, whether ready."""

    reqs: dict[int, Request] = field(default_factory=dict)
    since: float = field(default_factory=time.monotonic)
    warned_at: float = 0.0
    ready: bool = False


def left_the_job(ranks: list[int]) -> str:
    """Why an op cannot run: ``ranks`` shut down before they submitted it (one wording for
    a request that came before the goodbye and one that came after)."""
    who = f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))
    return (
        f"{who} left the job before submitting it (shutdown(): its function returned or "
        "raised, or it called shutdown() itself)"
    )


class Negotiation:
    """The decisions of :class:`~ringcore.engine.coordinator.Coordinator`: what they read
    of its state (set up in ``Coordinator.__init__``) and of its other parts."""

    cfg: Any
    process_sets: dict[int, list[int]]
    pending: dict[tuple[int, str], Pending]
    ready: list[tuple[int, str]]
    ready_since: float | None
    cache: dict[int, Request]
    cache_ids: dict[tuple[int, str], int]
    announced: set[int]
    stats: dict[str, int]
    joined: list[int]
    gone: set[int]
    next_ps_id: int
    autotuner: Any
    _broadcast: Callable[[Message], None]

    def _add_request(self, rank: int, sent: Request | CachedRequest | CachedId) -> None:
        req = self._full_request(sent)
        key = (req.process_set, req.name)
        entry = self.pending.setdefault(key, Pending())
        if rank in entry.reqs:
            self._send_error(
                [key],
                f"{req.kind} of {req.name!r} was submitted twice by rank {rank} before it completed; give concurrent ops distinct names",
            )
            return
        entry.reqs[rank] = req
        self._check_ready(key)

    def _full_request(self, sent: Request | CachedRequest | CachedId) -> Request:
        """The request ``sent`` stands for. A cached one that changed nothing is the
        cached template itself (the same object for every rank: see ``_check_ready``);
        one with a new shape or splits is the template with this call's fields."""
        if isinstance(sent, Request):
            return sent
        template = self.cache.get(sent.cache_id)
        if template is None:
            raise ValueError(f"a rank sent cache id {sent.cache_id!r}, which names no request")
        if isinstance(sent, CachedId) or (
            sent.shape == template.shape
            and sent.splits is None
            and sent.name == template.name
            and sent.process_set == template.process_set
        ):
            return template
        return sent.expand(template)

    def _members(self, ps: int) -> list[int]:
        return self.process_sets.get(ps, [])

    def _check_ready(self, key: tuple[int, str]) -> None:
        entry = self.pending.get(key)
        if entry is None or entry.ready:
            return
        ps, name = key
        members = self._members(ps)
        any_req = next(iter(entry.reqs.values()))
        if any_req.kind in CONTROL_KINDS:
            members = list(range(self.cfg.size))
        if len(entry.reqs) < len(members) and not self.joined and not self.gone:
            return  # the usual case while ranks submit: some have not yet, none left
        missing = [r for r in members if r not in entry.reqs]
        if not members:
            self._send_error(
                [key],
                f"{any_req.kind} of {name!r} uses process set {ps}, which does not exist (removed?)",
            )
            return
        gone_missing = [r for r in missing if r in self.gone]
        if gone_missing:
            self._send_error(
                [key],
                f"{any_req.kind} of {name!r}: {left_the_job(gone_missing)}",
                kind="peer",
            )
            return
        joined_missing = [r for r in missing if r in self.joined]
        if len(joined_missing) < len(missing):
            return
        if joined_missing and any_req.kind != _ALLREDUCE:
            self._send_error(
                [key],
                f"{any_req.kind} of {name!r} cannot run while ranks {joined_missing} have joined; only allreduce continues with joined ranks",
            )
            return
        if all(r is any_req for r in entry.reqs.values()):  # one cached template
            self.stats["agreed_by_id"] += 1
        else:
            problem = disagreement(name, entry.reqs)
            if problem:
                self._send_error([key], problem)
                return
            self.stats["agreed_by_fields"] += 1
        entry.ready = True
        self.ready.append(key)
        if self.ready_since is None:
            self.ready_since = time.monotonic()

    def _recheck_all(self) -> None:
        for key in list(self.pending):
            self._check_ready(key)
        live = [r for r in range(self.cfg.size) if r not in self.gone]
        if live and all(r in self.joined for r in live) and not self.ready:
            last = self.joined[-1]
            self.joined.clear()
            self._broadcast(ResponseBatch((ResponseItem(_JOIN, last=last),)))

    def _fail_waiting_on(self, rank: int, why: str) -> None:
        for key, entry in list(self.pending.items()):
            if not entry.ready and rank in self._members(key[0]) and rank not in entry.reqs:
                self._send_error(
                    [key],
                    f"{next(iter(entry.reqs.values())).kind} of {key[1]!r}: {why}",
                    kind="peer",
                )

    # -- responses --------------------------------------------------------------
    def _flush_if_due(self) -> None:
        if not self.ready:
            return
        waited = time.monotonic() - (self.ready_since or 0.0)
        # More ops on the way (some ranks submitted, others not yet)? Wait up to one
        # cycle to fuse them; otherwise answer now, so a blocking op never waits.
        partial = len(self.pending) > len(self.ready)  # ready keys are a subset of pending
        if partial and waited < self.cfg.cycle_time_s:
            return
        items = self._build_items(self.ready)
        self.ready, self.ready_since = [], None
        self._broadcast(ResponseBatch(tuple(items)))
        if self.autotuner is not None:
            moved = sum(
                nbytes(i.dtype, e.shape) for i in items if i.kind == _ALLREDUCE for e in i.entries
            )
            if self.autotuner.record(moved):
                self.cfg.fusion_threshold, self.cfg.cycle_time_s = self.autotuner.current()
        if self.joined:
            self._recheck_all()

    def _build_items(self, keys: list[tuple[int, str]]) -> list[ResponseItem]:
        """The response items for ``keys`` (ready ops, in order): allreduces of one
        dtype/op/scale/device fused up to the threshold, a group's allreduces together."""
        items: list[ResponseItem | Fusion] = []
        buckets = FusionBuckets(self.cfg.fusion_threshold)
        groups: dict[tuple, Fusion] = {}
        for key in keys:
            entry = self.pending.pop(key)
            ps = key[0]
            req = next(iter(entry.reqs.values()))
            meta = self._entry(key, req)
            if req.kind != _ALLREDUCE:
                items.append(self._item(ps, req, entry.reqs, meta))
                continue
            if req.group is not None:
                fused = groups.get((ps, req.group))
                if fused is None:
                    fused = groups[(ps, req.group)] = Fusion(req, ps)
                    items.append(fused)
                fused.entries.append(meta)
                continue
            sig = (ps, req.dtype, req.op, req.prescale, req.postscale, req.device)
            fused, fresh = buckets.place(sig, req, ps)
            if fresh:
                items.append(fused)
            fused.entries.append(meta)
        return [i.item() if isinstance(i, Fusion) else i for i in items]

    def _item(self, ps: int, req: Request, reqs: dict[int, Request], meta: Entry) -> ResponseItem:
        """The response item of one op that is not an allreduce."""
        k = req.kind
        item = ResponseItem(k, ps, req.dtype, (meta,), root=req.root)
        members = self._members(ps) if k not in CONTROL_KINDS else list(range(self.cfg.size))
        if k == _ALLGATHER:
            return replace(item, dims=tuple(reqs[r].shape[0] for r in members))
        if k == _ALLTOALL:
            return replace(item, splits=tuple(tuple(reqs[r].splits or ()) for r in members))
        if k == _PS_ADD:
            ranks = sorted(req.ranks or ())
            existing = [i for i, rs in self.process_sets.items() if rs == ranks]
            set_id = existing[0] if existing else self.next_ps_id
            if not existing:
                self.process_sets[self.next_ps_id] = ranks
                self.next_ps_id += 1
            return replace(item, set_id=set_id, ranks=tuple(ranks))
        if k == _PS_REMOVE:
            assert req.set_id is not None, "remove_process_set always names the set"
            self.process_sets.pop(req.set_id, None)
            return replace(item, set_id=req.set_id)
        if k == _REDUCESCATTER:
            return replace(item, op=req.op, prescale=req.prescale, postscale=req.postscale)
        return item

    def _entry(self, key: tuple[int, str], req: Request) -> Entry:
        """The response entry of ``req``: a bare cache id once every rank has seen the
        id in full and the shape is the template's (see ``Entry.compact``)."""
        cid = self._cache(key, req)
        if cid is None:
            return Entry(key[1], req.shape, None)
        if (
            cid in self.announced
            and req.shape == self.cache[cid].shape
            and req.kind not in CONTROL_KINDS  # every rank runs these before any look-up
        ):
            return Entry(key[1], req.shape, cid, compact=True)
        self.announced.add(cid)  # every rank reads this batch before any later one
        return Entry(key[1], req.shape, cid)

    def _cache(self, key: tuple[int, str], req: Request) -> int | None:
        if key in self.cache_ids:
            return self.cache_ids[key]
        if len(self.cache) >= self.cfg.cache_capacity:
            return None
        cid = len(self.cache)
        self.cache[cid] = req  # a template: CachedRequest.expand sets name, shape, splits
        self.cache_ids[key] = cid
        return cid

    def _send_error(
        self, keys: list[tuple[int, str]], message: str, kind: str = "mismatch"
    ) -> None:
        items = []
        for key in keys:
            self.pending.pop(key, None)
            if key in self.ready:  # rare: an error for a ready op
                self.ready.remove(key)
            items.append(
                ResponseItem(
                    _ERROR, key[0], entries=(Entry(key[1]),), message=message, error_kind=kind
                )
            )
        self._broadcast(ResponseBatch(tuple(items)))

    def _check_stalls(self, now: float) -> None:
        for key, entry in list(self.pending.items()):
            age = now - entry.since
            if entry.ready or age < self.cfg.stall_check_s:
                continue
            members = self._members(key[0])
            missing = [r for r in members if r not in entry.reqs and r not in self.joined]
            if self.cfg.stall_shutdown_s > 0 and age >= self.cfg.stall_shutdown_s:
                self._send_error(
                    [key],
                    f"{next(iter(entry.reqs.values())).kind} of {key[1]!r} stalled for {age:.0f} s: ranks "
                    f"{missing} never submitted it (RING_STALL_SHUTDOWN_TIME_SECONDS reached)",
                    kind="stall",
                )
                continue
            if now - entry.warned_at >= self.cfg.stall_check_s:
                entry.warned_at = now
                log.warning(
                    "Stalled op: %r (process set %d) was submitted by ranks %s %.0f s ago but ranks %s "
                    "have not submitted it. One rank may be skipping a collective the others run.",
                    key[1],
                    key[0],
                    sorted(entry.reqs),
                    age,
                    missing,
                )
