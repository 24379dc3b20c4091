"""The op engine of one rank: named async ops, handles, and their execution.

``submit`` (any thread) records the op locally and sends its request to the
coordinator (``_coordinator``); the engine's thread receives the coordinator's
ordered responses and runs them on the backend — fused allreduces through one flat
buffer — then resolves the handles. Every rank runs the same responses in the same
order, so the backend's collectives always match.

The fast lane: on a job whose ranks all share one host's shared-memory group, a caller
that waits for an op (``synchronize``, a blocking op) while every op this rank has
submitted is still queued here, each a cached allreduce, runs that whole batch in its
own thread, fused as the coordinator would, without the coordinator, once every rank
has voted for the same batch (``_shm_vote``); otherwise, and whenever the ranks
disagree, the ops take the coordinator's path as above. While the lane can be taken,
the sender thread waits for a cycle without new submissions before sending a burst.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import torch

from . import _adasum
from . import _config as cfg
from ._auth import AuthenticationError
from ._backends import Backend
from ._cuda_streams import device_scope, mark_ready
from ._device_pinning import device_of_type
from ._errors import CollectiveMismatchError, RendezvousError, RingInternalError
from ._gc import refresh_if_due
from ._handle import Handle, dtype_name, wait_handle
from ._ops import ReduceOp
from ._protocol import (
    Abort,
    CachedId,
    CachedRequest,
    Entry,
    FusionBuckets,
    Goodbye,
    JoinRequest,
    Request,
    RequestBatch,
    ResponseBatch,
    ResponseItem,
)
from ._reduction import average_, neutral_fill, scale_
from ._timeline import Timeline
from ._wire import HANDSHAKE_TIMEOUT_S, MessageTooLarge, connect_handshake

__all__ = ["Engine", "Handle", "InputHandle", "dtype_name", "wait_handle"]

log = logging.getLogger("ringtrain.ringcore.engine")

#: on a fast-lane job, how long the sender thread waits after the last op was queued
#: before it sends the queue to the coordinator (a waiting caller takes it first)
LANE_IDLE_S = 0.005
#: a fused allreduce of up to this many tensors goes straight into the shared-memory
#: segment (one copy per tensor each way); more are flattened first (one C call)
SLOT_FUSION_MAX = 64

_COLLECTIVE_PHASE = {
    "allreduce": "ALLREDUCE",
    "allgather": "ALLGATHER",
    "broadcast": "BROADCAST",
    "alltoall": "ALLTOALL",
    "reducescatter": "REDUCESCATTER",
    "barrier": "BARRIER",
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


class InputHandle(Handle):
    """A handle whose ``tensor`` is the caller's input, to be left as it is: the op's
    result is a new tensor, copied by the engine thread (Horovod reads the input when
    the op runs, too). A caller that copied it first would hand the GIL to the engine's
    threads on every op of a burst of async ops (every torch call releases it), and
    wait for it back each time."""


class Engine:
    def __init__(
        self,
        backend: Backend,
        rank: int,
        size: int,
        coordinator_addr: tuple[str, int],
        timeline: Timeline,
        connect_timeout_s: float = 120.0,
        cycle_time_s: float = 0.001,
        *,
        secret: str,
        control_timeout_s: float = 0.0,
        fusion_threshold: int = cfg.DEFAULT_FUSION_THRESHOLD,
        fast_lane: bool = True,
    ):
        """``control_timeout_s``: the longest rank 0 may stay silent (its coordinator
        sends a heartbeat when it has nothing else to send) before this rank counts it
        as hung (``RING_CONTROL_TIMEOUT_SECONDS``); 0: wait for ever.
        ``fusion_threshold`` and ``fast_lane``: rank 0's (``RING_FUSION_THRESHOLD``,
        ``RING_FAST_LANE`` and ``RING_AUTOTUNE``, sent to every rank at start-up), so the
        lane buckets and decides as the coordinator does on every rank."""
        self.backend = backend
        self.rank, self.size = rank, size
        self.timeline = timeline
        host, port = coordinator_addr
        self._peer = f"{host}:{port}"
        try:
            sock = socket.create_connection(coordinator_addr, timeout=connect_timeout_s)
            self.channel = connect_handshake(
                sock, secret, rank, timeout_s=min(connect_timeout_s, HANDSHAKE_TIMEOUT_S * 3)
            )
        except AuthenticationError as exc:
            raise RendezvousError(f"rank {rank}: {exc}") from None
        except OSError as exc:
            raise RendezvousError(
                f"rank {rank} could not reach the coordinator (rank 0) at {host}:{port} within "
                f"{connect_timeout_s:.0f} s ({type(exc).__name__}: {exc}). Check that the port "
                "is reachable from this host, or raise RING_START_TIMEOUT."
            ) from None
        self._lock = threading.Lock()
        self.pending: dict[tuple[int, str], Handle] = {}
        self.cache: dict[tuple[int, str], tuple[int, tuple]] = {}
        # every cache id this rank has seen in full: its name and the template's shape,
        # and the entry a bare id stands for (one object, reused for every bare id)
        self.cids: dict[int, tuple[str, tuple[int, ...], Entry]] = {}
        #: what the control path did (tests and bench/control_path.py read it): requests
        #: sent in full, as a cache id with this call's fields, as the bare id; requests
        #: a blocking op sent at once from its caller's thread; response entries that
        #: came as bare ids; ops run through a fusion buffer with others
        self.stats = dict.fromkeys(
            (
                "sent_full",
                "sent_cached",
                "sent_id",
                "sent_now",
                "entries_compact",
                "ops_fused",
                "fast",
                "ops_in_slot",
            ),
            0,
        )
        #: the fast lane's proposals (None: not a one-host shared-memory job, or
        #: RING_FAST_LANE=0); the execution lock: the backend is used by one thread at a
        #: time (the engine's, or a caller running its op in the fast lane)
        self.votes = _fast_lane_votes(backend, size) if fast_lane else None
        self._exec_lock = threading.Lock()
        self._fast_busy = False
        self._queued = 0  # ops queued so far (the sender's idle wait watches it grow)
        self.fusion_threshold = fusion_threshold
        self.groups: dict[int, Any] = {0: None}
        self.members: dict[int, list[int]] = {0: list(range(size))}
        self.counters: dict[str, itertools.count] = {}
        self.outbox: list[Request | CachedRequest | CachedId] = []
        self._bare: dict[int, CachedId] = {}
        self._send_lock = threading.Lock()
        self._outbox_ready = threading.Condition(self._lock)
        self.cycle_time_s = cycle_time_s
        self.silence_s = control_timeout_s
        self.join_handle: Handle | None = None
        self._t_resp = time.perf_counter()
        self._kind = ""
        self.broken: str | None = None
        self.closed = threading.Event()
        self.thread = threading.Thread(
            target=self._loop, name=f"ringcore-engine-{rank}", daemon=True
        )
        self.thread.start()
        self.sender = threading.Thread(
            target=self._sender, name=f"ringcore-sender-{rank}", daemon=True
        )
        self.sender.start()

    # -- submission (any thread) -------------------------------------------------
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
        open proposal aborts (``_shm_vote``)."""
        if self.votes is not None:
            sent = len(self.pending) - len(self.outbox)
            self.votes.set_busy(sent + (self.join_handle is not None))

    def _lane_batch(self) -> list[tuple[int, Handle]] | None:
        """Every op of this rank, as (cache id, handle), when they may take the fast lane
        (under ``self._lock``): all still queued here (none sent), each an allreduce of
        the whole job on CPU whose name is cached with this call's fields; else None."""
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
            if (
                ps != 0
                or req is None
                or req.kind != "allreduce"
                or req.device != "cpu"
                or req.group is not None
                or req.op == ReduceOp.Adasum
            ):
                return None
            cached = self.cache.get((0, name))
            if cached is None or cached[1] != h.sig:
                return None
            learnt = self.cids.get(cached[0])
            if learnt is None or learnt[1] != req.shape:
                return None
            batch.append((cached[0], h))
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
                pid = votes.propose(_batch_key([c for c, _ in batch]))
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
            return True
        finally:
            with self._lock:
                self._fast_busy = False
            self._exec_lock.release()

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
        self._kind = "allreduce"
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
        this rank's queued batch, else sending queued requests first."""
        if handle.done.is_set():
            return
        if self.votes is not None and self._run_lane() and handle.done.is_set():
            return
        self.flush()
        handle.done.wait()

    def _sender(self) -> None:
        while not self.closed.is_set():
            # between sends, and each second idle: the frozen heap's refresh, when due (_gc)
            refresh_if_due()
            with self._lock:
                if not self.outbox and not self.closed.is_set():
                    self._outbox_ready.wait(1.0)
                if not self.outbox:
                    continue
            time.sleep(self.cycle_time_s)  # let a burst of submissions gather
            if self.votes is not None:
                # the fast lane takes a whole burst when its caller waits: send only once
                # no op was queued during a whole LANE_IDLE_S this thread watched (ops
                # submitted and left unwaited on still leave within twice that of the
                # last one). Counted, not timed from the last op: a pause of the
                # submitting thread that holds the GIL (a full garbage collection: ~86 ms
                # with torch imported) would look like the end of its burst and send it
                # away from the lane
                idle = max(self.cycle_time_s, LANE_IDLE_S)
                seen = -1
                while (queued := self._queued) != seen:
                    seen = queued
                    time.sleep(idle)
            self.flush()

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
        handle = Handle("join", "join")
        with self._lock:
            if self.broken:
                raise RingInternalError(self.broken)
            self.join_handle = handle
            self._publish_busy()
        self.flush()  # everything submitted before join() reaches the coordinator first
        with self._send_lock:
            self.channel.send(JoinRequest().to_wire())
        return handle

    # -- the engine thread ---------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # this thread only moves data; autograd stays outside
        try:
            while True:
                msg = self.channel.recv(self.silence_s or None)
                if msg is None:
                    self._break(
                        "the coordinator (rank 0) closed its connection: rank 0 died or shut down"
                    )
                    return
                tag = msg["t"]
                if tag == ResponseBatch.TAG:
                    with self._exec_lock:  # after a caller's committed fast-lane op
                        self._t_resp = time.perf_counter()
                        self.timeline.cycle(self._t_resp)
                        for item in msg["items"]:
                            self._execute(item)
                        self.timeline.flush()
                elif tag == Abort.TAG:
                    self._break(msg["msg"])
                    return
                elif tag == Goodbye.TAG:
                    return
                # Heartbeat: rank 0 is alive; nothing to do
        except TimeoutError:
            self._break(self._silent_coordinator())
        except OSError as exc:  # reset, or silent past RING_CONTROL_TIMEOUT_SECONDS
            self._break(
                f"lost the control connection to the coordinator (rank 0 at {self._peer}): "
                f"{type(exc).__name__}: {exc}; rank 0's host is down or unreachable, or its "
                "process died"
            )
        except Exception as exc:  # never let the thread die silently
            log.exception("engine thread failed")
            self._break(f"the engine thread failed: {type(exc).__name__}: {exc}")
        finally:
            self.closed.set()

    def _silent_coordinator(self) -> str:
        return (
            f"the coordinator (rank 0 at {self._peer}) has sent nothing for "
            f"{self.silence_s:g} s, not even its heartbeat: rank 0 hangs (a stopped or "
            "stuck process keeps its connections open) or its host is unreachable "
            "(RING_CONTROL_TIMEOUT_SECONDS)"
        )

    def _coordinator_verdict(self) -> str | None:
        """After a backend collective failed (the backend names an address, not a
        rank): what the coordinator knows. A rank that died closed its control
        connection too, so the coordinator's abort naming it is here or on its way; if
        rank 0 itself died, its connection is closed; a live coordinator with nothing
        to say sends a heartbeat within a second, and one silent for
        ``RING_CONTROL_TIMEOUT_SECONDS`` hangs. None: rank 0 is alive and lost no rank
        (a peer hangs, or the failure was this rank's own).
        Responses read here are dropped: this rank's ring is broken anyway."""
        closed = "the coordinator (rank 0) closed its connection: rank 0 died or shut down"
        wait_s = self.silence_s if self.silence_s > 0 else 1.0
        fresh = False  # what was already buffered may predate the failure
        while True:
            try:
                msg = self.channel.recv(wait_s if fresh else 0.0)
            except TimeoutError:
                if not fresh:
                    fresh = True
                    continue
                return self._silent_coordinator() if self.silence_s > 0 else None
            except OSError:
                return closed
            except Exception:  # a frame it could not read: no verdict
                return None
            if msg is None:
                return closed
            if msg.get("t") == Abort.TAG:
                return str(msg.get("msg"))
            if fresh:
                return None

    def _break(self, why: str) -> None:
        with self._lock:
            self.broken = self.broken or why
            handles = list(self.pending.values())
            self.pending.clear()
            join = self.join_handle
            self.join_handle = None
        if self.votes is not None:
            with contextlib.suppress(Exception):
                self.votes.leave()  # no proposal opens again: this rank's ring is broken
        err = RingInternalError(f"rank {self.rank}: {why}")
        for h in handles:
            h.resolve(error=err)
        if join is not None:
            join.resolve(error=err)

    def _take(self, ps: int, name: str) -> Handle | None:
        with self._lock:
            handle = self.pending.pop((ps, name), None)
            self._publish_busy()
            return handle

    def _claim(self, ps: int, entries: tuple[Entry, ...]) -> list[Handle | None]:
        """Take the handles of ``entries`` (None: this rank joined, or the op was failed
        already) and learn their cache ids, under one hold of the lock that submitting
        threads take too."""
        with self._lock:
            handles = []
            for e in entries:
                key = (ps, e.name)
                h = self.pending.pop(key, None)
                handles.append(h)
                if e.cache_id is None:
                    continue
                if e.cache_id not in self.cids:
                    # the first entry to carry an id holds the template's name and shape
                    self.cids[e.cache_id] = (e.name, e.shape, Entry(e.name, e.shape, e.cache_id))
                if key not in self.cache and h is not None and h.sig is not None:
                    self.cache[key] = (e.cache_id, h.sig)
            self._publish_busy()
            return handles

    def _execute(self, wire_item: dict) -> None:
        """Run one response item as it came off the wire (a seam tests wrap)."""
        item = ResponseItem.from_wire(wire_item)
        kind, ps = item.kind, item.process_set
        if kind == "join":
            with self._lock:
                handle, self.join_handle = self.join_handle, None
                self._publish_busy()
            if handle is not None:
                handle.resolve(item.last)
            return
        if kind in ("ps_add", "ps_remove"):
            self._process_set_change(item)
            return
        if self.rank not in self.members.get(ps, []):
            return
        if any(e.compact for e in item.entries):
            item = replace(item, entries=self._expand(item.entries))
        handles = self._claim(ps, item.entries)
        if kind == "error":
            # a stall or a departed peer breaks the ring; a disagreement is the caller's error
            cls = (
                RingInternalError
                if item.error_kind in ("stall", "peer")
                else CollectiveMismatchError
            )
            for h in handles:
                if h is not None:
                    h.resolve(error=cls(item.message))
            return
        self._kind = kind  # the timeline's row names (engine thread only)
        try:
            run = getattr(self, f"_run_{kind}")
            with device_scope(handles):  # CUDA: on the side stream, after the producers
                run(item, handles)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
            verdict = self._coordinator_verdict()
            if verdict is not None:  # a rank named, instead of the backend's peer address
                why = f"{verdict} (the backend said: {why})"
            err = RingInternalError(
                f"{kind} of {[e.name for e in item.entries]} failed on rank {self.rank}: {why}"
            )
            for h in handles:
                if h is not None and not h.done.is_set():
                    h.resolve(error=err)
            self._break(f"a backend collective failed ({why})")

    def _expand(self, entries: tuple[Entry, ...]) -> tuple[Entry, ...]:
        """Entries that came as bare cache ids, with the name and shape they stand for."""
        out = []
        cids = self.cids
        for e in entries:
            if e.compact:
                learnt = cids.get(e.cache_id)  # type: ignore[arg-type]
                if learnt is None:  # the coordinator sends an id only once every rank has it
                    raise RingInternalError(
                        f"rank {self.rank} got cache id {e.cache_id} it was never told about"
                    )
                e = learnt[2]
            out.append(e)
        self.stats["entries_compact"] += sum(e.compact for e in entries)
        return tuple(out)

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
        if op == ReduceOp.Average:
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
        if op == ReduceOp.Adasum or (len(bufs) == 1 and inputs[0]):
            # reduced where they are: a caller's input is copied first
            bufs = [b.clone() if keep else b for b, keep in zip(bufs, inputs)]
            inputs = [False] * len(bufs)
        if op == ReduceOp.Adasum:
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
            _adasum.adasum_(buf, self.members[item.process_set], self.rank, self.backend, group)
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
            if item.kind == "ps_add":
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

    # -- shutdown -------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        if self.votes is not None:
            with contextlib.suppress(Exception):
                self.votes.leave()
        if not self.closed.is_set():
            self.flush()
            with contextlib.suppress(OSError), self._send_lock:
                self.channel.send(Goodbye().to_wire())
            self.closed.wait(timeout_s)
        with self._lock:
            self._outbox_ready.notify_all()
        self.channel.close()


def _fast_lane_votes(backend: Backend, size: int) -> Any:
    """The shared-memory group's proposals when every rank of the job is in it (a flat
    plan); else None."""
    shm = getattr(backend, "shm", None)
    if getattr(backend, "mode", None) != "flat" or shm is None or shm.local_size != size:
        return None
    return getattr(shm, "votes", None)


def _batch_key(cids: list[int]) -> int:
    """One int64 naming a batch of cache ids (sorted): the proposal's key. Hashes of int
    tuples are the same in every process (no hash randomisation for ints)."""
    return hash((len(cids), tuple(cids))) & ((1 << 62) - 1)
