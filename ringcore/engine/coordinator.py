"""The coordinator: decides, for every rank, which named ops run and in what order.

It runs as a thread of rank 0. Every rank (rank 0 too) holds one control connection
to it and sends each op it submits as a small request (name, kind, dtype, shape,
reduce op, root, scale factors, process set); once every member rank of the op's
process set has submitted a name, the coordinator checks that the requests agree
and sends the same ordered response list to every rank, which then runs the ops in
that order. Ranks may therefore submit in different orders and from any thread.

This module holds the thread and its connections: accepting the ranks (each proves
the job's secret), reading their messages, the loss of a rank (its connection closes
without a goodbye: every rank is told to abort its pending ops), and a heartbeat to
every rank whenever it has had nothing else to send for a while (so that the ranks can
tell a live but waiting rank 0 from a hung one). What it decides — readiness, the
agreement check, the response cache, tensor fusion, join, the stall inspector — is the
part it is made of, ``negotiation``; ``autotune`` tunes its fusion threshold and cycle.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import selectors
import socket
import threading
import time
from dataclasses import dataclass

from .._auth import AuthenticationError
from .autotune import Autotuner
from .messages import Abort, Goodbye, Heartbeat, JoinRequest, Message, RequestBatch, decode_message
from .negotiation import Negotiation, Pending, left_the_job
from .protocol import Request
from .wire import HANDSHAKE_TIMEOUT_S, Channel, VersionMismatch, accept_handshake, encode

__all__ = ["Coordinator", "CoordinatorConfig"]

log = logging.getLogger("ringtrain.ringcore.coordinator")
#: handshakes in flight at once beyond the ranks' own: a flood of strangers is hung up
#: on (and counted in ``refused``) instead of costing a thread each
SPARE_HANDSHAKES = 64


@dataclass
class CoordinatorConfig:
    size: int
    fusion_threshold: int
    cycle_time_s: float
    cache_capacity: int
    stall_check_s: float
    stall_shutdown_s: float
    stall_check_enabled: bool = True
    autotune: bool = False
    autotune_log: str | None = None
    start_timeout_s: float = 120.0
    heartbeat_s: float = 0.0  # a Heartbeat after this long with nothing sent; 0: none


class Coordinator(Negotiation):
    """Rank 0's decision thread. ``secret``: the job's secret every rank must prove it
    knows (kept in a private attribute, never logged or shown by a repr)."""

    def __init__(self, config: CoordinatorConfig, secret: str, host: str = "0.0.0.0"):
        if not secret:
            raise ValueError("the coordinator needs the job's secret (got an empty one)")
        self.cfg = config
        self._secret = secret
        self.refused = 0  # connections that failed the handshake (tests read it)
        self._handshaking: set[socket.socket] = set()
        self.server = socket.create_server((host, 0), backlog=max(config.size, 8))
        self.port = self.server.getsockname()[1]
        self.channels: dict[int, Channel] = {}
        self.mismatched: dict[int, str] = {}  # ranks refused for their ringtrain version
        self.process_sets: dict[int, list[int]] = {0: list(range(config.size))}
        self.pending: dict[tuple[int, str], Pending] = {}
        self.ready: list[tuple[int, str]] = []
        self.ready_since: float | None = None
        self.cache: dict[int, Request] = {}
        self.cache_ids: dict[tuple[int, str], int] = {}
        self.announced: set[int] = set()  # cache ids every rank has seen in a full entry
        #: how requests arrived: frames read, and those of them one rank sent for its
        #: host (the host relay); ops whose requests agreed by their cache id alone /
        #: after the field-by-field comparison (tests and bench read it)
        self.stats = {
            "agreed_by_id": 0,
            "agreed_by_fields": 0,
            "request_frames": 0,
            "relayed_frames": 0,
        }
        self.joined: list[int] = []
        self.gone: set[int] = set()
        self.aborted = False
        self.last_sent = time.monotonic()  # the heartbeat's clock
        self.next_ps_id = 1
        self.autotuner = None
        if config.autotune:
            self.autotuner = Autotuner(config.autotune_log)
            self.cfg.fusion_threshold, self.cfg.cycle_time_s = self.autotuner.current()
        self.thread = threading.Thread(target=self._serve, name="ringcore-coordinator", daemon=True)

    # -- life cycle -------------------------------------------------------------
    def start(self) -> None:
        self.thread.start()

    def _accept_all(self, timeout_s: float) -> None:
        """Accept until every rank has connected and passed the handshake.

        Handshakes run in their own short-lived threads, so a peer that connects and
        says nothing cannot hold up the ranks behind it; a peer that fails the
        handshake is closed and nothing it sent is read."""
        deadline = time.monotonic() + timeout_s
        done: queue.Queue[tuple[int, Channel | VersionMismatch]] = queue.Queue()
        self.server.settimeout(0.2)
        try:
            while len(self.channels) + len(self.mismatched) < self.cfg.size:
                self._heartbeat_if_due()  # the ranks already in wait for the others
                while not done.empty():
                    self._admit(*done.get())
                if len(self.channels) + len(self.mismatched) == self.cfg.size:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = [
                        r
                        for r in range(self.cfg.size)
                        if r not in self.channels and r not in self.mismatched
                    ]
                    raise TimeoutError(
                        f"ranks {missing} of {self.cfg.size} did not connect to the coordinator "
                        f"within {timeout_s:.0f} s" + self._mismatch_text("; and ")
                    )
                try:
                    sock, peer = self.server.accept()
                except TimeoutError:
                    continue
                if len(self._handshaking) >= SPARE_HANDSHAKES + self.cfg.size:
                    self.refused += 1
                    sock.close()
                    continue
                self._handshaking.add(sock)
                threading.Thread(
                    target=self._handshake,
                    args=(sock, peer, min(HANDSHAKE_TIMEOUT_S, left), done),
                    name="ringcore-handshake",
                    daemon=True,
                ).start()
        finally:
            self.server.close()
            for sock in list(self._handshaking):  # strangers still talking: hang up
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def _mismatch_text(self, lead: str = "") -> str:
        """Why the ranks refused for their version were refused ("" if none were)."""
        if not self.mismatched:
            return ""
        return lead + "; ".join(self.mismatched[r] for r in sorted(self.mismatched))

    def _handshake(self, sock: socket.socket, peer: object, timeout_s: float, done) -> None:
        admitted: tuple[int, Channel | VersionMismatch]
        try:
            admitted = accept_handshake(sock, self._secret, timeout_s)
        except VersionMismatch as exc:  # one of the job's ranks, on another version
            log.error("coordinator refused rank %d: %s", exc.rank, exc)
            admitted = (exc.rank, exc)
        except AuthenticationError as exc:
            self.refused += 1
            log.warning("coordinator refused a connection: %s", exc)
            return
        finally:
            self._handshaking.discard(sock)  # before put(): an admitted rank is never hung up
        done.put(admitted)

    def _admit(self, rank: int, ch: Channel | VersionMismatch) -> None:
        if isinstance(ch, VersionMismatch):
            if 0 <= rank < self.cfg.size and rank not in self.channels:
                self.mismatched[rank] = str(ch)
            return
        if not 0 <= rank < self.cfg.size or rank in self.channels or rank in self.mismatched:
            log.warning("coordinator refused a second or unknown rank %d from %r", rank, ch)
            self.refused += 1
            ch.close()
            return
        self.channels[rank] = ch

    def _serve(self) -> None:
        try:
            self._serve_ranks()
        except Exception as exc:  # never die without telling the ranks
            log.exception("coordinator failed")
            with contextlib.suppress(Exception):
                self._abort(f"the coordinator on rank 0 failed: {type(exc).__name__}: {exc}")
            for ch in self.channels.values():
                ch.close()

    def _serve_ranks(self) -> None:
        try:
            self._accept_all(timeout_s=self.cfg.start_timeout_s)
        except OSError as exc:
            log.error("coordinator: ranks did not all connect: %s", exc)
            self._abort(f"not every rank connected to the coordinator ({exc})")
            for ch in self.channels.values():
                ch.close()
            return
        if self.mismatched:  # every rank is accounted for: fail them all, saying why
            self._abort(self._mismatch_text())
            for ch in self.channels.values():
                ch.close()
            return
        sel = selectors.DefaultSelector()
        for rank, ch in self.channels.items():
            sel.register(ch.sock, selectors.EVENT_READ, rank)
        lost: list[int] = []
        for rank, ch in self.channels.items():  # what arrived together with the handshake
            messages, ok = ch.buffered()
            for msg in messages:
                self._handle(rank, msg)
            if not ok:
                lost.append(rank)
        for rank in lost:
            sel.unregister(self.channels[rank].sock)
            self._lose(rank)
        last_stall_check = time.monotonic()
        while len(self.gone) < self.cfg.size:
            events = sel.select(timeout=self._select_timeout())
            for key, _ in events:
                rank = key.data
                messages, alive = self.channels[rank].recv_available()
                for msg in messages:
                    self._handle(rank, msg)
                if not alive:
                    sel.unregister(key.fileobj)
                    self._lose(rank)
            self._flush_if_due()
            self._heartbeat_if_due()
            now = time.monotonic()
            if self.cfg.stall_check_enabled and now - last_stall_check >= min(
                self.cfg.stall_check_s, 1.0
            ):
                last_stall_check = now
                self._check_stalls(now)
        sel.close()
        for ch in self.channels.values():
            ch.close()

    def _lose(self, rank: int) -> None:
        ch = self.channels[rank]
        if ch.error is not None:
            log.error("coordinator: dropping rank %d: %s", rank, ch.error)
        if rank not in self.gone:
            self.gone.add(rank)
            if isinstance(ch.error, AuthenticationError):
                why = "sent a message that failed its HMAC check"
            elif ch.error is not None and not isinstance(ch.error, OSError):
                why = f"sent a control message the coordinator could not read ({ch.error})"
            else:
                why = "lost its control connection (the process died or its host is unreachable)"
            self._abort(f"rank {rank} {why}")
        ch.close()

    def _select_timeout(self) -> float:
        if self.ready and self.ready_since is not None:
            return max(0.0, self.cfg.cycle_time_s - (time.monotonic() - self.ready_since))
        return min(1.0, self.cfg.heartbeat_s) if self.cfg.heartbeat_s > 0 else 1.0

    def _heartbeat_if_due(self) -> None:
        """Tell every rank that rank 0 is alive, when nothing else went out for a while."""
        if self.cfg.heartbeat_s > 0 and time.monotonic() - self.last_sent >= self.cfg.heartbeat_s:
            self._broadcast(Heartbeat())

    # -- messages ---------------------------------------------------------------
    def _handle(self, rank: int, wire: dict) -> None:
        msg = decode_message(wire)
        if isinstance(msg, RequestBatch):
            self.stats["request_frames"] += 1
            if msg.ranks is None:
                for req in msg.requests:
                    self._add_request(rank, req)
                return
            ranks = self._relayed_for(rank, msg.ranks)
            if ranks is None:
                return
            self.stats["relayed_frames"] += 1
            for req in msg.requests:
                for r in ranks:
                    self._add_request(r, req)
        elif isinstance(msg, JoinRequest):
            if rank not in self.joined:
                self.joined.append(rank)
            self._recheck_all()
        elif isinstance(msg, Goodbye):
            self.gone.add(rank)
            self._fail_waiting_on(rank, left_the_job([rank]))
            self.channels[rank].send(Goodbye().to_wire())

    def _relayed_for(self, rank: int, ranks: tuple[int, ...]) -> tuple[int, ...] | None:
        """The ranks a relayed batch stands for, checked: a block of consecutive ranks
        that holds the sender (its host's: ranks are numbered host by host where the relay
        runs). A claim of any other ranks is a defect of ours, not a user's: the job
        aborts, saying so, rather than run ops some rank never asked for."""
        ok = (
            bool(ranks)
            and all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)
            and ranks == tuple(range(ranks[0], ranks[0] + len(ranks)))
            and ranks[0] >= 0
            and ranks[-1] < self.cfg.size
            and rank in ranks
        )
        if ok:
            return ranks
        self._abort(
            f"rank {rank} sent requests for ranks {list(ranks)[:16]}, which are not a block of "
            "its host's ranks; this is a ringtrain defect, please report it"
        )
        return None

    def _broadcast(self, message: Message) -> None:
        self.last_sent = time.monotonic()
        data = encode(message.to_wire())
        # the other ranks first: rank 0's own engine, woken here, would hold the GIL
        for rank, ch in sorted(self.channels.items(), key=lambda rc: rc[0] == 0):
            if rank in self.gone and not isinstance(message, Abort):
                continue
            with contextlib.suppress(OSError):
                ch.send_encoded(data)

    def _abort(self, why: str) -> None:
        if self.aborted:
            return
        self.aborted = True
        self.pending.clear()
        self.ready = []
        self._broadcast(Abort(why))
