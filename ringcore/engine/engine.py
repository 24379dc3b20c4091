"""The op engine of one rank: named async ops, handles, and their execution.

``submit`` (any thread) records the op locally and sends its request to the
coordinator (``coordinator``); the engine's thread receives the coordinator's
ordered responses and runs them on the backend — fused allreduces through one flat
buffer — then resolves the handles. Every rank runs the same responses in the same
order, so the backend's collectives always match. On a one-host shared-memory job a
waiting caller may run its rank's queued batch itself (the fast lane); across hosts,
one rank of a host may send the batch its host's ranks agreed on for them all (the
host relay).

:class:`Engine` is one object whose methods live by job in this room's modules, each a
part it is made of: ``submit`` (submission and the sender thread), ``lane`` (the fast
lane), ``receive`` (the engine thread's receive loop and failure diagnosis) and
``execute`` (running an item on the backend). This module holds what they share: the
state made here, and ``close``. One object, not four: the per-op path is measured in
microseconds, and a hop between objects per op would show.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import _config as cfg
from .._auth import AuthenticationError
from .._errors import RendezvousError
from .._ops import OpKind
from ..backends.protocol import Backend
from .execute import Execution
from .handle import Handle
from .lane import FastLane, lane_votes
from .messages import Goodbye
from .protocol import CachedId, CachedRequest, Entry, Request
from .receive import Receiver
from .submit import Submission
from .timeline import Timeline
from .wire import HANDSHAKE_TIMEOUT_S, connect_handshake

__all__ = ["Engine"]


def _nothing() -> None:
    return None


class Engine(Submission, FastLane, Receiver, Execution):
    """One rank's engine: connected to rank 0's coordinator, with its sender thread and
    its engine thread running once made."""

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
        on_idle: Callable[[], object] = _nothing,
    ):
        """``control_timeout_s``: the longest rank 0 may stay silent (its coordinator
        sends a heartbeat when it has nothing else to send) before this rank counts it
        as hung (``RING_CONTROL_TIMEOUT_SECONDS``); 0: wait for ever.
        ``fusion_threshold`` and ``fast_lane``: rank 0's (``RING_FUSION_THRESHOLD``,
        ``RING_FAST_LANE`` and ``RING_AUTOTUNE``, sent to every rank at start-up), so the
        lane buckets and decides as the coordinator does on every rank. ``on_idle``: what
        the sender thread runs between its sends and on each second it idles, never
        inside an op (the runtime's heap refresh)."""
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
        #: came as bare ids; ops run through a fusion buffer with others; ops run in the
        #: fast lane, and those of them the coordinator had not cached; ops this rank's
        #: host agreed on and one of its ranks sent for the host (the host relay)
        self.stats = dict.fromkeys(
            (
                "sent_full",
                "sent_cached",
                "sent_id",
                "sent_now",
                "entries_compact",
                "ops_fused",
                "fast",
                "fast_uncached",
                "ops_in_slot",
                "relayed",
            ),
            0,
        )
        #: the host's proposals (None: no shared-memory group holds this rank's host, or
        #: RING_FAST_LANE=0), and the host relay's ranks (this host's, on a hierarchical
        #: plan; None on one host: the fast lane); the execution lock: the backend is used
        #: by one thread at a time (the engine's, or a caller running its op in the lane)
        self.votes, self.relay_ranks = lane_votes(backend, size) if fast_lane else (None, None)
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
        self._kind = OpKind.ALLREDUCE  # the kind being run (the timeline's row names)
        self._runs = self._runners()
        self._on_idle = on_idle
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
