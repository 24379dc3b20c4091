"""The op engine of one rank: named async ops, handles, and their execution.

``submit`` (any thread) records the op locally and sends its request to the
coordinator (``_coordinator``); the engine's thread receives the coordinator's
ordered responses and runs them on the backend — fused allreduces through one flat
buffer — then resolves the handles. Every rank runs the same responses in the same
order, so the backend's collectives always match.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _adasum, _gpu
from ._auth import AuthenticationError
from ._errors import CollectiveMismatchError, RendezvousError, RingInternalError
from ._ops import ReduceOp
from ._timeline import Timeline
from ._wire import HANDSHAKE_TIMEOUT_S, connect_handshake

log = logging.getLogger("ringtrain.ringcore.engine")

_COLLECTIVE_PHASE = {
    "allreduce": "ALLREDUCE",
    "allgather": "ALLGATHER",
    "broadcast": "BROADCAST",
    "alltoall": "ALLTOALL",
    "reducescatter": "REDUCESCATTER",
    "barrier": "BARRIER",
}


# The request fields a cached id stands for (shape and splits travel every time).
_SIGNATURE = ("k", "d", "o", "r", "pre", "post", "dev", "g", "gn")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass
class Handle:
    """What ``*_async`` returns: poll it, or ``synchronize`` it for the result."""

    name: str
    kind: str
    done: threading.Event = field(default_factory=threading.Event)
    result: Any = None
    error: BaseException | None = None
    # execution state
    tensor: torch.Tensor | None = None  # the buffer the collective runs on (output)
    finish: Any = None  # callable(result) -> user result
    submitted: float = field(default_factory=time.perf_counter)
    sig: tuple | None = None  # the request's signature, for the response cache
    event: Any = None  # CUDA: ready on the submitting stream after this event (see _gpu)

    def resolve(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done.set()


class Engine:
    def __init__(
        self,
        backend: Any,
        rank: int,
        size: int,
        coordinator_addr: tuple[str, int],
        timeline: Timeline,
        connect_timeout_s: float = 120.0,
        cycle_time_s: float = 0.001,
        *,
        secret: str,
    ):
        self.backend = backend
        self.rank, self.size = rank, size
        self.timeline = timeline
        host, port = coordinator_addr
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
        self.groups: dict[int, Any] = {0: None}
        self.members: dict[int, list[int]] = {0: list(range(size))}
        self.counters: dict[str, itertools.count] = {}
        self.outbox: list[dict] = []
        self._send_lock = threading.Lock()
        self._outbox_ready = threading.Condition(self._lock)
        self.cycle_time_s = cycle_time_s
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

    def submit(self, handle: Handle, req: dict) -> Handle:
        """Register ``handle`` and queue ``req`` (its fields: see _coordinator)."""
        self.submit_many([(handle, req)])
        return handle

    def submit_many(self, items: list[tuple[Handle, dict]]) -> None:
        """Register ops and queue their requests for the coordinator.

        Requests are not sent one by one: a syscall per op, with the GIL handed back and
        forth, would cost more than the op. The sender thread sends what is queued at
        most one cycle later, and ``flush()`` (called by a blocking wait) sends at once.
        """
        with self._lock:
            if self.broken:
                raise RingInternalError(self.broken)
            for handle, req in items:
                key = (req.get("ps", 0), handle.name)
                if key in self.pending:
                    raise ValueError(
                        f"an op named {handle.name!r} is already in flight on this rank; wait "
                        "for it or give the new one another name"
                    )
                self.pending[key] = handle
                _gpu.mark_ready(handle)
                self.outbox.append(self._compact(key, req, handle))
            if len(self.outbox) == len(items):  # the outbox was empty: wake the sender
                self._outbox_ready.notify()

    def flush(self) -> None:
        """Send every queued request now (batches leave in the order they were queued)."""
        with self._send_lock:
            with self._lock:
                batch, self.outbox = self.outbox, []
            if batch:
                try:
                    self.channel.send({"t": "req", "reqs": batch})
                except OSError as exc:
                    self._break(f"the coordinator is unreachable ({exc}); rank 0 may have died")

    def wait(self, handle: Any) -> None:
        """Block until ``handle`` is done, sending queued requests first."""
        if not handle.done.is_set():
            self.flush()
            handle.done.wait()

    def _sender(self) -> None:
        while not self.closed.is_set():
            with self._lock:
                while not self.outbox and not self.closed.is_set():
                    self._outbox_ready.wait(1.0)
            time.sleep(self.cycle_time_s)  # let a burst of submissions gather
            self.flush()

    def _compact(self, key: tuple[int, str], req: dict, handle: Handle) -> dict:
        """The request as sent: a small cache id once the coordinator has seen it."""
        sig = tuple(req.get(k) for k in _SIGNATURE)
        handle.sig = sig
        cached = self.cache.get(key)
        if cached is not None and cached[1] == sig:
            short = {"c": cached[0], "n": req["n"], "s": req["s"], "ps": req.get("ps", 0)}
            if "sp" in req:
                short["sp"] = req["sp"]
            return short
        return req

    def join(self) -> Handle:
        handle = Handle("join", "join")
        with self._lock:
            if self.broken:
                raise RingInternalError(self.broken)
            self.join_handle = handle
        self.flush()  # everything submitted before join() reaches the coordinator first
        with self._send_lock:
            self.channel.send({"t": "join"})
        return handle

    # -- the engine thread ---------------------------------------------------------
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # this thread only moves data; autograd stays outside
        try:
            while True:
                msg = self.channel.recv()
                if msg is None:
                    self._break(
                        "the coordinator (rank 0) closed its connection: rank 0 died or shut down"
                    )
                    return
                if msg["t"] == "resp":
                    self._t_resp = time.perf_counter()
                    self.timeline.cycle(self._t_resp)
                    for item in msg["items"]:
                        self._execute(item)
                    self.timeline.flush()
                elif msg["t"] == "abort":
                    self._break(msg["msg"])
                    return
                elif msg["t"] == "bye":
                    return
        except Exception as exc:  # never let the thread die silently
            log.exception("engine thread failed")
            self._break(f"the engine thread failed: {type(exc).__name__}: {exc}")
        finally:
            self.closed.set()

    def _break(self, why: str) -> None:
        with self._lock:
            self.broken = self.broken or why
            handles = list(self.pending.values())
            self.pending.clear()
            join = self.join_handle
            self.join_handle = None
        err = RingInternalError(f"rank {self.rank}: {why}")
        for h in handles:
            h.resolve(error=err)
        if join is not None:
            join.resolve(error=err)

    def _take(self, ps: int, name: str) -> Handle | None:
        with self._lock:
            return self.pending.pop((ps, name), None)

    def _remember(self, ps: int, entries: list[dict]) -> None:
        with self._lock:
            for e in entries:
                if e.get("c") is not None and (ps, e["n"]) not in self.cache:
                    h = self.pending.get((ps, e["n"]))
                    sig = h.sig if h is not None else None
                    if sig is not None:
                        self.cache[(ps, e["n"])] = (e["c"], sig)

    def _execute(self, item: dict) -> None:
        kind, ps = item["k"], item.get("ps", 0)
        if kind == "join":
            with self._lock:
                handle, self.join_handle = self.join_handle, None
            if handle is not None:
                handle.resolve(item["last"])
            return
        if kind in ("ps_add", "ps_remove"):
            self._process_set_change(item)
            return
        if self.rank not in self.members.get(ps, []):
            return
        self._remember(ps, item["e"])
        handles = [self._take(ps, e["n"]) for e in item["e"]]
        if kind == "error":
            # a stall or a departed peer breaks the ring; a disagreement is the caller's error
            cls = (
                RingInternalError if item.get("x") in ("stall", "peer") else CollectiveMismatchError
            )
            for h in handles:
                if h is not None:
                    h.resolve(error=cls(item["msg"]))
            return
        self._kind = kind  # the timeline's row names (engine thread only)
        try:
            run = getattr(self, f"_run_{kind}")
            with _gpu.device_scope(handles):  # CUDA: on the side stream, after the producers
                run(item, handles)
        except Exception as exc:
            err = RingInternalError(
                f"{kind} of {[e['n'] for e in item['e']]} failed on rank {self.rank}: "
                f"{type(exc).__name__}: {exc}"
            )
            for h in handles:
                if h is not None and not h.done.is_set():
                    h.resolve(error=err)
            self._break(f"a backend collective failed ({type(exc).__name__}: {exc})")

    def _finish(self, h: Handle, value: Any) -> None:
        try:
            h.resolve(h.finish(value) if h.finish else value)
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
        self, entry: dict, dtype: torch.dtype, op: int, dev: str | None = None
    ) -> torch.Tensor:
        shape = entry["s"]
        if op == ReduceOp.Min:
            fill = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
        elif op == ReduceOp.Max:
            fill = torch.finfo(dtype).min if dtype.is_floating_point else torch.iinfo(dtype).min
        elif op == ReduceOp.Product:
            fill = 1
        else:
            fill = 0
        return torch.full(shape, fill, dtype=dtype, device=_gpu.device_of_type(dev))

    def _run_allreduce(self, item: dict, handles: list[Handle | None]) -> None:
        t_start = time.perf_counter()
        op, group = ReduceOp(item["o"]), self.groups[item["ps"]]
        n = len(self.members[item["ps"]])
        dtype = getattr(torch, item["d"])
        bufs: list[torch.Tensor] = [
            h.tensor
            if h is not None and h.tensor is not None
            else self._neutral(e, dtype, op, item.get("dev"))
            for h, e in zip(handles, item["e"])
        ]
        for h, e in zip(handles, item["e"]):
            self._span(h, e["n"], "QUEUE", h.submitted if h else t_start, t_start)
        if op == ReduceOp.Adasum:
            for buf, h, e in zip(bufs, handles, item["e"]):
                t0 = time.perf_counter()
                _scale(buf, item["pre"])
                _adasum.adasum_(buf, self.members[item["ps"]], self.rank, self.backend, group)
                _scale(buf, item["post"])
                self._span(h, e["n"], "ADASUM", t0, time.perf_counter())
        else:
            if len(bufs) == 1:
                flat, t1 = bufs[0].view(-1), time.perf_counter()
            else:
                flat = torch.cat([b.reshape(-1) for b in bufs])
                t1 = time.perf_counter()
                for h, e in zip(handles, item["e"]):
                    self._span(h, e["n"], "MEMCPY_IN_FUSION_BUFFER", t_start, t1)
            _scale(flat, item["pre"])
            self.backend.allreduce(flat, op, group)
            if op == ReduceOp.Average:
                if flat.dtype.is_floating_point or flat.dtype.is_complex:
                    flat.div_(n)
                else:
                    flat.copy_(torch.div(flat, n, rounding_mode="trunc"))
            _scale(flat, item["post"])
            t2 = time.perf_counter()
            for h, e in zip(handles, item["e"]):
                self._span(h, e["n"], "ALLREDUCE", t1, t2)
            if len(bufs) > 1:
                offset = 0
                for b in bufs:
                    b.view(-1).copy_(flat[offset : offset + b.numel()])
                    offset += b.numel()
                t3 = time.perf_counter()
                for h, e in zip(handles, item["e"]):
                    self._span(h, e["n"], "MEMCPY_OUT_FUSION_BUFFER", t2, t3)
        for h, b in zip(handles, bufs):
            if h is not None:
                self._finish(h, b)

    def _run_allgather(self, item: dict, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item["e"]
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e["n"], "QUEUE", h.submitted, t0)
        out = self.backend.allgather(h.tensor, item["dims"], self.groups[item["ps"]])
        self._span(h, e["n"], "ALLGATHER", t0, time.perf_counter())
        self._finish(h, out)

    def _run_broadcast(self, item: dict, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item["e"]
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e["n"], "QUEUE", h.submitted, t0)
        self.backend.broadcast(
            h.tensor, item["r"], self.members[item["ps"]], self.groups[item["ps"]]
        )
        self._span(h, e["n"], "BROADCAST", t0, time.perf_counter())
        self._finish(h, h.tensor)

    def _run_alltoall(self, item: dict, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item["e"]
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e["n"], "QUEUE", h.submitted, t0)
        members = self.members[item["ps"]]
        me = members.index(self.rank)
        send = item["splits"][me]
        recv = [row[me] for row in item["splits"]]
        out = self.backend.alltoall(h.tensor, send, recv, self.groups[item["ps"]])
        self._span(h, e["n"], "ALLTOALL", t0, time.perf_counter())
        self._finish(h, (out, torch.tensor(recv, dtype=torch.int64)))

    def _run_reducescatter(self, item: dict, handles: list[Handle | None]) -> None:
        (h,), (e,) = handles, item["e"]
        assert h is not None and h.tensor is not None
        t0 = time.perf_counter()
        self._span(h, e["n"], "QUEUE", h.submitted, t0)
        members = self.members[item["ps"]]
        n, me = len(members), members.index(self.rank)
        x, op = h.tensor, ReduceOp(item["o"])
        rows = x.shape[0]
        base, extra = divmod(rows, n)
        _scale(x, item["pre"])
        self.backend.allreduce(x, op, self.groups[item["ps"]])
        if op == ReduceOp.Average:
            if x.dtype.is_floating_point:
                x.div_(n)
            else:
                x.copy_(torch.div(x, n, rounding_mode="trunc"))
        _scale(x, item["post"])
        start = me * base + min(me, extra)
        out = x[start : start + base + (1 if me < extra else 0)].clone()
        self._span(h, e["n"], "REDUCESCATTER", t0, time.perf_counter())
        self._finish(h, out)

    def _run_barrier(self, item: dict, handles: list[Handle | None]) -> None:
        self.backend.barrier(self.groups[item["ps"]])
        for h in handles:
            if h is not None:
                self._finish(h, None)

    def _process_set_change(self, item: dict) -> None:
        handle = self._take(0, item["e"][0]["n"])
        try:
            if item["k"] == "ps_add":
                ranks = item["ranks"]
                if item["id"] not in self.groups:
                    # every rank creates every group, in the coordinator's order
                    self.groups[item["id"]] = self.backend.new_group(ranks, self.size)
                    self.members[item["id"]] = ranks
                result: Any = item["id"]
            else:
                self.groups.pop(item["id"], None)
                self.members.pop(item["id"], None)
                result = None
        except Exception as exc:
            if handle is not None:
                handle.resolve(error=RingInternalError(f"process set change failed: {exc}"))
            return
        if handle is not None:
            handle.resolve(result)

    # -- shutdown -------------------------------------------------------------------
    def close(self, timeout_s: float = 10.0) -> None:
        if not self.closed.is_set():
            self.flush()
            with contextlib.suppress(OSError), self._send_lock:
                self.channel.send({"t": "bye"})
            self.closed.wait(timeout_s)
        with self._lock:
            self._outbox_ready.notify_all()
        self.channel.close()


def wait_handle(handle: Any) -> None:
    """Wait for a handle of the running engine, sending its queued requests first."""
    if handle.done.is_set():
        return
    from ._runtime import _state

    if _state is not None and _state.engine is not None:
        _state.engine.flush()
    handle.done.wait()


def _scale(tensor: torch.Tensor, factor: float) -> None:
    if factor == 1.0:
        return
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex:
        tensor.mul_(factor)
    else:  # integers scale as Horovod's C++ core does: multiply, truncate
        tensor.copy_((tensor.to(torch.float64) * factor).trunc().to(tensor.dtype))
