"""Submission and the sender: how an op leaves a rank (a part of :class:`Engine`).

``submit`` (any thread) records the op and queues its request; the sender thread sends
the queue to the coordinator at most one cycle later, a blocking op sends it from its
own thread at once (``now``), and a caller that waits flushes it first or takes the
fast lane (``lane``). Requests are compacted once the coordinator has cached a name:
its id and what changed, or the bare id.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from typing import Any

from .._errors import RingInternalError
from .._ops import OpKind
from .cuda_streams import mark_ready
from .handle import Handle
from .lane import LANE_IDLE_S, lane_kind
from .messages import JoinRequest, RequestBatch
from .protocol import CachedId, CachedRequest, Entry, Request
from .wire import Channel, MessageTooLarge

__all__ = ["HOLD_MAX_S", "Submission"]

#: on a fast-lane job, how long after the last submission the sender keeps ops that their
#: submitter waits for next (``Handle.held``) before it sends them to the coordinator
HOLD_MAX_S = 1.0


class Submission:
    """The submitting side of :class:`~ringcore.engine.engine.Engine`: what it reads of
    the engine's state (set up in ``Engine.__init__``) and of its other parts."""

    _lock: threading.Lock
    _send_lock: threading.Lock
    _outbox_ready: threading.Condition
    channel: Channel
    pending: dict[tuple[int, str], Handle]
    outbox: list[Request | CachedRequest | CachedId]
    cache: dict[tuple[int, str], tuple[int, tuple]]
    cids: dict[int, tuple[str, tuple[int, ...], Entry]]
    _bare: dict[int, CachedId]
    counters: dict[str, itertools.count]
    stats: dict[str, int]
    votes: Any
    broken: str | None
    join_handle: Handle | None
    closed: threading.Event
    cycle_time_s: float
    _queued: int
    _on_idle: Callable[[], object]
    _break: Callable[[str], None]
    _take: Callable[[int, str], Handle | None]
    _run_lane: Callable[[], bool]
    _relay: Callable[[], bool]
    relay_ranks: tuple[int, ...] | None

    def auto_name(self, kind: str) -> str:
        with self._lock:
            counter = self.counters.setdefault(kind, itertools.count())
            return f"{kind}.noname.{next(counter)}"

    def submit(self, handle: Handle, req: Request, *, now: bool = False) -> Handle:
        """Register ``handle`` and queue ``req`` for the coordinator (``now``: see
        :meth:`submit_many`)."""
        self.submit_many([(handle, req)], now=now)
        return handle

    def submit_many(self, items: list[tuple[Handle, Request]], *, now: bool = False) -> None:
        """Register ops and queue their requests for the coordinator.

        Requests are not sent one by one: a syscall per op, with the GIL handed back and
        forth, would cost more than the op. The sender thread sends what is queued at
        most one cycle later, and ``flush()`` (called by a blocking wait) sends at once.
        ``now``: the caller waits for these ops next (a blocking op), so it sends the
        queue itself, at once, and the sender thread is not woken (two thread wake-ups
        per op that a blocking op would pay for nothing); ``stats["sent_now"]`` counts
        them.
        """
        if now and self.votes is not None:
            self._queue(items, wake=False)  # the caller's wait takes the lane, or sends them
            return
        if now:
            with self._send_lock:  # flush()'s order: the send lock, then the engine's
                self._queue(items, wake=False)
                self.stats["sent_now"] += len(items)
                self._send_queued()
            return
        self._queue(items, wake=True)

    def _queue(self, items: list[tuple[Handle, Request]], wake: bool) -> None:
        with self._lock:
            if self.broken:
                raise RingInternalError(self.broken)
            for handle, req in items:
                key = (req.process_set, handle.name)
                if key in self.pending:
                    raise ValueError(
                        f"an op named {handle.name!r} is already in flight on this rank; wait "
                        "for it or give the new one another name"
                    )
                self.pending[key] = handle
                mark_ready(handle)
                handle.req = req
                self.outbox.append(self._compact(key, req, handle))
            self._queued += len(items)
            if wake and len(self.outbox) == len(items):  # it was empty: wake the sender
                self._outbox_ready.notify()

    def _publish_busy(self) -> None:
        """Tell the host's ranks how many ops this rank has in flight through the
        coordinator (sent, not yet run; a join), under ``self._lock``; from 0 to more, an
        open proposal aborts (``ringcore.shm.vote``)."""
        if self.votes is not None:
            sent = len(self.pending) - len(self.outbox)
            self.votes.set_busy(sent + (self.join_handle is not None))

    def flush(self) -> None:
        """Send every queued request now (batches leave in the order they were queued)."""
        with self._send_lock:
            self._send_queued()

    def _send_queued(self) -> None:
        """``flush()`` under the send lock, which the caller holds."""
        with self._lock:
            batch, self.outbox = self.outbox, []
            if batch:
                self._publish_busy()  # before they leave: an open proposal aborts
        if batch:
            try:
                self._send_requests(batch)
            except OSError as exc:
                self._break(f"the coordinator is unreachable ({exc}); rank 0 may have died")

    def _send_requests(self, batch: list[Request | CachedRequest | CachedId]) -> None:
        """``batch`` in one frame, or in several when one would be over the frame limit.
        A request over it on its own (a name of many MiB) fails its op here and is never
        sent: every rank that submits that name fails alike, and the job goes on."""
        try:
            self.channel.send(RequestBatch(tuple(batch)).to_wire())
        except MessageTooLarge as exc:
            if len(batch) > 1:
                half = len(batch) // 2
                self._send_requests(batch[:half])
                self._send_requests(batch[half:])
                return
            req = batch[0]
            if isinstance(req, CachedId):  # a few bytes: never over the limit alone
                raise
            handle = self._take(req.process_set, req.name)
            if handle is not None:
                shown = req.name if len(req.name) <= 60 else req.name[:60] + "..."
                handle.resolve(
                    error=ValueError(
                        f"{handle.kind} of {shown!r} (a name of {len(req.name)} characters) "
                        f"cannot be sent to the coordinator: {exc}. Give the op a shorter name"
                    )
                )

    def wait(self, handle: Any) -> None:
        """Block until ``handle`` is done: through the fast lane when every rank votes for
        this rank's queued batch (across hosts: sent once for the host when the host's ranks
        do), else sending queued requests first."""
        if handle.done.is_set():
            return
        if self.votes is not None:
            if self.relay_ranks is not None:
                self._relay()  # taken or not, what is still queued is sent below
            elif self._run_lane() and handle.done.is_set():
                return
        self.flush()
        handle.done.wait()

    def _sender(self) -> None:
        while not self.closed.is_set():
            # between sends, and each second idle: what the runtime asked for (the frozen
            # heap's refresh, when due: ringcore.runtime.heap)
            self._on_idle()
            with self._lock:
                if not self.outbox and not self.closed.is_set():
                    self._outbox_ready.wait(1.0)
                if not self.outbox:
                    continue
            time.sleep(self.cycle_time_s)  # let a burst of submissions gather
            if self.votes is not None and self.relay_ranks is None:
                # one host: hold a burst for the lane. Not across hosts, where every op
                # still goes through the coordinator: there, gradients sent as backward
                # makes them are answered, and run, while backward goes on
                self._await_lane()
            self.flush()

    def _await_lane(self) -> None:
        """On a fast-lane job, what the sender waits for before it sends the queue.

        The lane takes a whole burst when its caller waits: send only once no op was
        queued during a whole ``LANE_IDLE_S`` this thread watched (ops submitted and left
        unwaited on still leave within twice that of the last one). Counted, not timed
        from the last op: a pause of the submitting thread that holds the GIL (a full
        garbage collection: ~86 ms with torch imported) would look like the end of its
        burst and send it away from the lane.

        Ops whose submitter waits for them next (``Handle.held``: the gradients that
        ``DistributedOptimizer.step()`` waits for) stay queued while they are all the
        queue holds, up to ``HOLD_MAX_S`` after the last one came: a backward pass of
        large layers leaves more than ``LANE_IDLE_S`` between two gradients, and sending
        the first ones would take the whole step's gradients to the coordinator."""
        idle = max(self.cycle_time_s, LANE_IDLE_S)
        seen, changed = -1, time.monotonic()
        while not self.closed.is_set():
            queued = self._queued
            if queued != seen:
                seen, changed = queued, time.monotonic()
            elif not self._all_held() or time.monotonic() - changed >= HOLD_MAX_S:
                return
            time.sleep(idle)

    def _all_held(self) -> bool:
        """Every op of this rank is queued here, each one its submitter waits for next and
        of a kind the lane runs. Any other (a CUDA gradient, one of a process set) leaves
        as before: on its path the coordinator's early start overlaps it with backward."""
        with self._lock:
            return (
                bool(self.outbox)
                and len(self.pending) == len(self.outbox)
                and all(
                    h.held and ps == 0 and lane_kind(h.req) for (ps, _), h in self.pending.items()
                )
            )

    def _compact(
        self, key: tuple[int, str], req: Request, handle: Handle
    ) -> Request | CachedRequest | CachedId:
        """The request as sent (under ``self._lock``): once the coordinator has cached it,
        its id and what changed (the shape, the splits), or the bare id when nothing did."""
        sig = req.signature()
        handle.sig = sig
        cached = self.cache.get(key)
        if cached is None or cached[1] != sig:
            self.stats["sent_full"] += 1
            return req
        cid = cached[0]
        learnt = self.cids.get(cid)
        if learnt is not None and req.splits is None and learnt[1] == req.shape:
            self.stats["sent_id"] += 1
            bare = self._bare.get(cid)  # one per id, not one per op: less for the collector
            if bare is None:
                bare = self._bare[cid] = CachedId(cid)
            return bare
        self.stats["sent_cached"] += 1
        return req.cached(cid)

    def join(self) -> Handle:
        handle = Handle("join", OpKind.JOIN)
        with self._lock:
            if self.broken:
                raise RingInternalError(self.broken)
            self.join_handle = handle
            self._publish_busy()
        self.flush()  # everything submitted before join() reaches the coordinator first
        with self._send_lock:
            self.channel.send(JoinRequest().to_wire())
        return handle
