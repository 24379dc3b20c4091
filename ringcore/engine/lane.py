"""The fast lane: on a job whose ranks all share one host's shared-memory group, a caller
that waits for an op (``synchronize``, a blocking op) while every op this rank has
submitted is still queued here, each an allreduce, runs that whole batch in its own
thread, fused as the coordinator would, without the coordinator, once every rank has
voted for the same batch (``ringcore.shm.vote``); otherwise, and whenever the ranks
disagree, the ops take the coordinator's path. An op is named in the vote by its cache
id when the coordinator has cached it, else by a digest of the whole request
(:func:`request_key`): an unnamed op (named by a counter, never cached) or a name seen
for the first time takes the lane as a repeated one does. While the lane can be taken, the sender
thread waits for a cycle without new submissions before sending a burst
(:data:`LANE_IDLE_S`).

**Across hosts** (a hierarchical plan: each host's ranks share a segment) the coordinator
still orders every op, since only rank 0 sees every host's, but each host negotiates for
itself (the *host relay*): the host's ranks vote on their batch as on one host
(``ringcore.shm.vote``, with ``acks``), and once they agree, the rank whose vote
completed the agreement (the one that knows it first, with no wait) sends the batch
once, for all of them, while the others send nothing. The coordinator then reads one
frame per host instead of one per rank. Ranks that disagree (or a vote that times out)
send their own requests, and the coordinator compares them field by field as always. A
part of :class:`~ringcore.engine.engine.Engine`.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable
from typing import Any, cast

import torch

from .._errors import RingInternalError
from .._ops import OpKind, ReduceOp
from .fusion import FusionBuckets
from .handle import Handle
from .messages import RequestBatch
from .protocol import CachedId, CachedRequest, Entry, Request
from .timeline import Timeline

__all__ = ["LANE_IDLE_S", "FastLane", "batch_key", "lane_kind", "lane_votes", "request_key"]

#: on a fast-lane job, how long the sender thread waits after the last op was queued
#: before it sends the queue to the coordinator (a waiting caller takes it first)
LANE_IDLE_S = 0.005
_ALLREDUCE, _ADASUM = OpKind.ALLREDUCE, ReduceOp.Adasum
_UNCACHED = 1 << 62  # request_key's keys are at or above it, cache ids below
#: the longest name of an op the coordinator has not cached that the lane takes: a longer
#: one goes the coordinator's way, which refuses a name over the control frame's limit
#: (so a name is refused alike on one host and on several)
LANE_NAME_MAX = 4096


class FastLane:
    """The fast lane of :class:`~ringcore.engine.engine.Engine`: what it reads of the
    engine's state (set up in ``Engine.__init__``) and of its other parts."""

    _lock: threading.Lock
    _exec_lock: threading.Lock
    pending: dict[tuple[int, str], Handle]
    outbox: list[Request | CachedRequest | CachedId]
    cache: dict[tuple[int, str], tuple[int, tuple]]
    cids: dict[int, tuple[str, tuple[int, ...], Entry]]
    stats: dict[str, int]
    votes: Any
    broken: str | None
    join_handle: Handle | None
    timeline: Timeline
    fusion_threshold: int
    rank: int
    relay_ranks: tuple[int, ...] | None
    channel: Any
    _send_lock: threading.Lock
    _fast_busy: bool
    _kind: OpKind
    _break: Callable[[str], None]
    _allreduce_bufs: Callable[..., None]
    _publish_busy: Callable[[], None]

    def _lane_batch(self) -> list[tuple[int, Handle]] | None:
        """Every op of this rank, as (key, handle), when they may take the fast lane (under
        ``self._lock``): all still queued here (none sent), each an allreduce of the whole
        job on CPU; else None. The key: the cache id when the name is cached with this
        call's fields and shape, else :func:`request_key`."""
        if (
            not self.outbox
            or len(self.pending) != len(self.outbox)
            or self.broken
            or self.join_handle is not None
            or self._fast_busy
            or self.timeline.active
        ):
            return None
        batch = []
        for (ps, name), h in self.pending.items():
            req = h.req
            if ps != 0 or not lane_kind(req):
                return None
            cached = self.cache.get((0, name))
            learnt = self.cids.get(cached[0]) if cached is not None else None
            if cached is not None and cached[1] == h.sig and learnt and learnt[1] == req.shape:
                batch.append((cached[0], h))  # the coordinator's id: every rank learnt it
            elif len(name) > LANE_NAME_MAX:  # the coordinator checks it against the frame
                return None
            else:  # a name not cached (unnamed: a counter's), or cached with other fields
                # the bindings reuse one request per name and shape: its key is kept on
                # it (with what it was computed from: ``expand`` copies a request's dict)
                kept = req.__dict__.get("_lane_key")
                if kept is None or kept[0] != (name, req.shape):
                    key = request_key(name, req.signature(), req.shape)
                    kept = req.__dict__["_lane_key"] = ((name, req.shape), key)
                batch.append((kept[1], h))
        return batch

    def _run_lane(self) -> bool:
        """Run every queued op of this rank in this thread if every rank votes for the same
        batch now (see the module's docstring); False: nothing was run."""
        votes = self.votes
        assert votes is not None
        with self._lock:
            batch = self._lane_batch()
            if batch is None or not self._exec_lock.acquire(blocking=False):
                return False  # not eligible, or the engine thread is running a batch
            batch.sort(key=lambda ch: ch[0])
            try:
                pid = votes.propose(batch_key([c for c, _ in batch]))
            except BaseException:
                self._exec_lock.release()
                raise
            if pid is None:
                self._exec_lock.release()
                return False
            taken, self.outbox = self.outbox, []
            for _, h in batch:
                del self.pending[(0, h.name)]
            self._fast_busy = True
        try:
            if not votes.wait(pid):
                with self._lock:  # back in the queue, ahead of what came since
                    broken = self.broken
                    if broken is None:
                        for _, h in batch:
                            self.pending[(0, h.name)] = h
                        self.outbox = taken + self.outbox
                if broken is not None:  # the ring broke while they were out of the queue
                    err = RingInternalError(f"rank {self.rank}: {broken}")
                    for _, h in batch:
                        h.resolve(error=err)
                return False
            self._run_batch(batch)
            self.stats["fast"] += len(batch)
            self.stats["fast_uncached"] += sum(key >= _UNCACHED for key, _ in batch)
            return True
        finally:
            with self._lock:
                self._fast_busy = False
            self._exec_lock.release()

    def _relay(self) -> bool:
        """Across hosts: send this rank's queued batch to the coordinator once for the whole
        host when every rank of the host votes for the same batch now, from the rank whose
        vote completed the agreement (see the module's docstring). False: nothing was
        taken (the caller sends as usual)."""
        votes, ranks = self.votes, self.relay_ranks
        assert votes is not None and ranks is not None
        with self._lock:
            batch = self._lane_batch()
            if batch is None:
                return False
            batch.sort(key=lambda ch: ch[0])
            pid = votes.propose(batch_key([c for c, _ in batch]))
            if pid is None:
                return False
            # out of the queue while the host votes (the sender must not send them too);
            # still pending: the coordinator's response runs them as any other op
            taken, self.outbox = self.outbox, []
            self._fast_busy = True
        try:
            committed = votes.wait(pid)
            if not committed:
                with self._lock:  # back in the queue, ahead of what came since
                    if self.broken is None:
                        self.outbox = taken + self.outbox
                return False
            if votes.committed_here == pid:  # the last to agree: it knows first
                try:
                    with self._send_lock:
                        self.channel.send(RequestBatch(tuple(taken), ranks).to_wire())
                except OSError as exc:
                    self._break(f"the coordinator is unreachable ({exc}); rank 0 may have died")
            with self._lock:
                self._publish_busy()  # sent (for the host): in flight from now on
            self.stats["relayed"] += len(batch)
            return True
        finally:
            with self._lock:
                self._fast_busy = False

    def _run_batch(self, batch: list[tuple[int, Handle]]) -> None:
        """Run a committed batch (sorted by cache id): allreduces of one dtype, op and
        scale fused up to the fusion threshold, in the same order on every rank."""
        buckets = FusionBuckets(self.fusion_threshold)
        handles: dict[int, list[Handle]] = {}
        for _, h in batch:
            r = h.req
            fusion, fresh = buckets.place((r.dtype, r.op, r.prescale, r.postscale), r, 0)
            if fresh:
                handles[id(fusion)] = [h]
            else:
                handles[id(fusion)].append(h)
        self._kind = _ALLREDUCE
        for fusion in buckets.fusions:
            # no Entry per op (the timeline, which names them, is off in the lane): the
            # item carries the fusion's dtype, op and scales; its handles, the buffers
            hs = handles[id(fusion)]
            bufs = cast("list[torch.Tensor]", [h.tensor for h in hs])  # a lane op has one
            try:
                self._allreduce_bufs(fusion.item(), hs, bufs, op=ReduceOp(fusion.req.op))
            except Exception as exc:
                why = f"{type(exc).__name__}: {exc}"
                err = RingInternalError(
                    f"allreduce of {[h.name for h in hs]} failed on rank {self.rank}: {why}"
                )
                for _, h in batch:
                    if not h.done.is_set():
                        h.resolve(error=err)
                self._break(f"a backend collective failed ({why})")
                return


def lane_kind(req: Any) -> bool:
    """Whether an op of process set 0 is of a kind the lane runs: an allreduce of CPU
    tensors, not Adasum, not a member of a grouped allreduce."""
    return (
        req is not None
        and req.kind == _ALLREDUCE
        and req.device == "cpu"
        and req.group is None
        and req.op != _ADASUM
    )


def lane_votes(backend: Any, size: int) -> tuple[Any, tuple[int, ...] | None]:
    """The shared-memory group's proposals, and the host relay's ranks: ``(votes, None)``
    when every rank of the job is in the group (a flat plan: the fast lane); ``(votes,
    the host's ranks)`` on a hierarchical plan (the host relay); else ``(None, None)``."""
    shm: Any = getattr(backend, "shm", None)
    votes = getattr(shm, "votes", None)
    mode = getattr(backend, "mode", None)
    if votes is None:
        return None, None
    if mode == "flat" and shm.local_size == size:
        return votes, None
    if mode == "hierarchical":
        votes.acks = True
        return votes, tuple(backend.plan.local)
    return None, None


def request_key(name: str, sig: tuple, shape: tuple[int, ...]) -> int:
    """A lane key for an op the coordinator has not cached: a 64-bit digest of its name,
    the fields every rank must agree on, and its shape, at or above ``1 << 62`` (above any
    cache id). Every rank that submits the same op computes the same key (``repr`` of
    strings, ints, floats and enums, and BLAKE2b, are the same in every process; ``hash``
    of a string is not), so the ranks vote on the whole request. Ranks that disagree on
    any field propose different keys: the proposal aborts and the coordinator, which
    compares field by field, raises the mismatch on every rank, naming the field."""
    digest = hashlib.blake2b(repr((name, sig, shape)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") | _UNCACHED


def batch_key(cids: list[int]) -> int:
    """One int64 naming a batch of op keys (sorted: cache ids and ``request_key``s): the
    proposal's key. Hashes of int tuples are the same in every process (no hash
    randomisation for ints)."""
    return hash((len(cids), tuple(cids))) & ((1 << 62) - 1)
