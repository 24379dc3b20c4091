"""The receive loop, with failure diagnosis: the engine thread reads the coordinator's
messages, runs each response item in order (``execute``) and, when the ring breaks,
fails every pending op with a message that names the cause: a lost rank, rank 0 gone or
silent, a backend collective that failed. A part of
:class:`~ringcore.engine.engine.Engine`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from .._errors import CollectiveMismatchError, RingInternalError
from .._ops import OpKind
from .cuda_streams import device_scope
from .handle import Handle
from .messages import Abort, Goodbye, ResponseBatch, decode_message
from .protocol import Entry, ResponseItem
from .timeline import Timeline
from .wire import Channel

__all__ = ["Receiver"]

log = logging.getLogger("ringtrain.ringcore.engine")

_JOIN, _ERROR = OpKind.JOIN, OpKind.ERROR
_PS_CHANGES = (OpKind.PS_ADD, OpKind.PS_REMOVE)
_CLOSED = "the coordinator (rank 0) closed its connection: rank 0 died or shut down"


class Receiver:
    """The engine thread of :class:`~ringcore.engine.engine.Engine`: what it reads of the
    engine's state (set up in ``Engine.__init__``) and of its other parts."""

    _lock: threading.Lock
    _exec_lock: threading.Lock
    channel: Channel
    pending: dict[tuple[int, str], Handle]
    cache: dict[tuple[int, str], tuple[int, tuple]]
    cids: dict[int, tuple[str, tuple[int, ...], Entry]]
    stats: dict[str, int]
    votes: Any
    broken: str | None
    join_handle: Handle | None
    closed: threading.Event
    timeline: Timeline
    members: dict[int, list[int]]
    rank: int
    silence_s: float
    _peer: str
    _t_resp: float
    _kind: OpKind
    _runs: dict[OpKind, Callable[[ResponseItem, list[Handle | None]], None]]
    _publish_busy: Callable[[], None]
    _process_set_change: Callable[[ResponseItem], None]

    # -- the engine thread ---------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # this thread only moves data; autograd stays outside
        try:
            while True:
                frame = self.channel.recv(self.silence_s or None)
                if frame is None:
                    self._break(_CLOSED)
                    return
                msg = decode_message(frame)
                if type(msg) is ResponseBatch:
                    with self._exec_lock:  # after a caller's committed fast-lane op
                        self._t_resp = time.perf_counter()
                        self.timeline.cycle(self._t_resp)
                        for item in msg.items:
                            self._execute(item)
                        self.timeline.flush()
                elif type(msg) is Abort:
                    self._break(msg.reason)
                    return
                elif type(msg) is Goodbye:
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
        wait_s = self.silence_s if self.silence_s > 0 else 1.0
        fresh = False  # what was already buffered may predate the failure
        while True:
            try:
                frame = self.channel.recv(wait_s if fresh else 0.0)
                msg = None if frame is None else decode_message(frame)
            except TimeoutError:
                if not fresh:
                    fresh = True
                    continue
                return self._silent_coordinator() if self.silence_s > 0 else None
            except OSError:
                return _CLOSED
            except Exception:  # a frame it could not read: no verdict
                return None
            if frame is None:
                return _CLOSED
            if type(msg) is Abort:
                return str(msg.reason)
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

    def _execute(self, item: ResponseItem) -> None:
        """Run one response item, in the coordinator's order (a seam tests wrap)."""
        kind, ps = item.kind, item.process_set
        if kind == _JOIN:
            with self._lock:
                handle, self.join_handle = self.join_handle, None
                self._publish_busy()
            if handle is not None:
                handle.resolve(item.last)
            return
        if kind in _PS_CHANGES:
            self._process_set_change(item)
            return
        if self.rank not in self.members.get(ps, []):
            return
        if any(e.compact for e in item.entries):
            item = replace(item, entries=self._expand(item.entries))
        handles = self._claim(ps, item.entries)
        if kind == _ERROR:
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
            run = self._runs[kind]
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
