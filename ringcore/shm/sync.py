"""Barriers between the ranks of one host: sequence counters in shared memory, a short
spin, then a blocking wait on a wake-up socket, with liveness checks of the peers.

**Counters.** Each rank owns one 64-byte control line of the segment and is its only
writer: ``seq`` (how many phases it has posted), ``pid``, ``sleeping`` (it blocks on its
socket) and ``closed``. A barrier is: post (``seq += 1``), then wait until every peer's
``seq`` has reached ours. The words are aligned int64, read and written through a
``memoryview`` cast to ``"q"`` (one 8-byte ``mov``: no torn values).

**Wake-ups.** Each rank binds a Unix datagram socket ``<rank>`` in the group's private
folder (``ringshm-<prefix>-<token>.d`` beside the segment, mode 0700, made by local
rank 0 and checked by every rank: ``files``), through ``/proc/self/fd/<folder
fd>`` (the folder's own descriptor: no name can be swapped between the check and the
bind, and the path stays short). Another user can neither bind a name there nor
connect to one. Once every rank has bound, each connects one socket to every peer's
(``connect_peers``: a connected datagram socket keeps its peer without the name), and
the names and the folder are removed with the segment's name: nothing is left in the
file system and nobody else can reach the sockets. (Abstract-namespace names, used
before, have no permissions and are listed in ``/proc/net/unix``: any local process
could take one first.) ``eventfd`` would need such a socket to pass descriptors.

A waiter spins for ``spin_s`` (200 us; the fast path when the peer is running),
calling ``sched_yield`` between checks (on a full 2-core host the peer may be queued
behind us: measured under load, this halves the median 4 KB allreduce and cuts its CPU
time by 3x compared with a pure spin), then sets ``sleeping``, drains its socket (at
most :data:`_DRAIN_MAX` datagrams: a stream of them cannot hold a waiter past its
deadline), re-checks the counters and ``poll``s. A poster sends one byte to every peer
whose ``sleeping`` is set. An idle rank therefore sleeps in ``poll``: no
core burnt.

The flag/counter pair is a Dekker pattern, which needs a store-load fence on both
sides; the waiter has one (its ``recv`` syscall takes kernel locks: a locked
instruction, a full barrier on x86-64), the poster has none in pure Python. A wake-up
could in theory be lost if the poster's counter store stayed in its store buffer for
the microseconds the waiter spends in ``recv``; the waiter's ``poll`` timeout is
therefore short and grows (1 ms, 2 ms, ... 50 ms), bounding such a loss to ~1 ms.

**Memory ordering.** A rank writes its data (torch kernels: ordinary stores, or glibc
``memcpy``, whose non-temporal path ends with ``sfence``) and then its counter; a peer
reads the counter and then the data. This relies on x86-64's TSO: stores are not
reordered with older stores, loads not with older loads. Weaker architectures
(aarch64, POWER) would need real fences that pure Python cannot issue; the group is
only offered on x86-64 (``ordering_supported``).

**Liveness.** Each waiter polls a ``pidfd`` of every peer (Linux >= 5.3): it becomes
readable the moment the peer exits, even as a zombie, so a SIGKILLed rank fails the
others at once. Without pidfds the waiter checks ``/proc/<pid>/stat`` at every poll
timeout (<= 50 ms). ``timeout_s`` bounds every wait.
"""

from __future__ import annotations

import contextlib
import os
import platform
import select
import socket
import time
from collections.abc import Sequence

from .._errors import RingError

__all__ = ["Sync", "ordering_supported"]

SEQ, PID, SLEEPING, CLOSED = 0, 1, 2, 3
_WORDS = 8
_MAX_SLEEP_S = 0.05
_DRAIN_MAX = 64  # wake-ups read per check (any more wait for the next)


def ordering_supported() -> bool:
    """True where the hardware's memory model makes counter-after-data safe (x86-64)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def _in(dir_fd: int, rank: int) -> str:
    return f"/proc/self/fd/{dir_fd}/{rank}"


def bind_socket(dir_fd: int, rank: int) -> socket.socket:
    """This rank's wake-up socket, bound as ``<rank>`` in the folder ``dir_fd``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(_in(dir_fd, rank))
    except BaseException:
        sock.close()
        raise
    sock.setblocking(False)
    return sock


def connect_peers(dir_fd: int, me: int, size: int) -> dict[int, socket.socket]:
    """One socket connected to every peer's wake-up socket (all bound in ``dir_fd``)."""
    senders: dict[int, socket.socket] = {}
    try:
        for j in range(size):
            if j != me:
                senders[j] = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
                senders[j].connect(_in(dir_fd, j))
                senders[j].setblocking(False)
    except BaseException:
        for s in senders.values():
            s.close()
        raise
    return senders


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
        return state not in (b"Z", b"X")
    except (FileNotFoundError, IndexError):
        return False
    except OSError:
        return True


class Sync:
    """Barriers over the control lines ``ctrl`` (a ``"q"`` memoryview of L x 8 words);
    ``sock``: this rank's wake-up socket, ``senders``: one connected to each peer's."""

    spin_s = 200e-6

    def __init__(
        self,
        ctrl: memoryview,
        me: int,
        size: int,
        sock: socket.socket,
        senders: dict[int, socket.socket],
        ranks: Sequence[int] | None = None,
    ):
        """``ranks``: the job's (or group's) rank of each local rank, in local order, so
        that a failure names the rank a user knows; None: local ranks only."""
        self.ctrl, self.me, self.size, self.sock = ctrl, me, size, sock
        self.ranks = list(ranks) if ranks is not None else None
        self.seq = int(ctrl[me * _WORDS + SEQ])
        self.peers = [j for j in range(size) if j != me]
        self.senders = senders
        self.pids = {j: int(ctrl[j * _WORDS + PID]) for j in self.peers}
        self._seq_at = [j * _WORDS + SEQ for j in self.peers]
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)
        self._pidfds: dict[int, int] = {}
        self._dead: set[int] = set()
        for j, pid in self.pids.items():
            self._watch(j, pid)
        self._watched = set(self._pidfds.values())  # the others: /proc checks

    def _watch(self, j: int, pid: int) -> None:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise RingError(
                f"local rank {j} (pid {pid}) exited before the shared-memory group formed"
            ) from None
        except (AttributeError, OSError):  # no pidfds here: /proc checks instead
            return
        self._pidfds[fd] = j
        self._poll.register(fd, select.POLLIN)

    def post(self) -> None:
        """Announce that this rank finished its part of the current phase."""
        self.seq += 1
        ctrl = self.ctrl
        ctrl[self.me * _WORDS + SEQ] = self.seq
        for j in self.peers:
            if ctrl[j * _WORDS + SLEEPING]:
                self._send(j)

    def _send(self, j: int) -> None:
        # a wake-up already queued, or the peer is gone (its pidfd will tell)
        with contextlib.suppress(BlockingIOError, ConnectionError):
            self.senders[j].send(b"\0")

    def barrier(self, what: str, timeout_s: float) -> None:
        self.post()
        self.wait(what, timeout_s)

    def wait(self, what: str, timeout_s: float) -> None:
        """Return once every peer has posted as many phases as this rank."""
        ctrl, target = self.ctrl, self.seq
        t_end = time.perf_counter() + self.spin_s
        while True:
            if all(ctrl[i] >= target for i in self._seq_at):
                return
            if time.perf_counter() > t_end:
                break
            os.sched_yield()  # a 2-core host is often full: let the peer we wait for run
        self._sleep(target, what, timeout_s)

    def _drain(self) -> None:
        """Read the wake-ups queued so far, at most :data:`_DRAIN_MAX`: bounded, so a
        stream of datagrams cannot hold a waiter here past its deadline."""
        with contextlib.suppress(BlockingIOError):
            for _ in range(_DRAIN_MAX):
                self.sock.recv(64)

    def _lagging(self, target: int) -> list[int]:
        return [j for j in self.peers if self.ctrl[j * _WORDS + SEQ] < target]

    def _sleep(self, target: int, what: str, timeout_s: float) -> None:
        ctrl, flag = self.ctrl, self.me * _WORDS + SLEEPING
        deadline = time.monotonic() + timeout_s
        delay = 0.001
        ctrl[flag] = 1
        try:
            while True:
                self._drain()  # a syscall: orders the flag store before the counter loads
                lagging = self._lagging(target)
                if not lagging:
                    return
                self._check_peers(lagging, what)
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RingError(
                        f"{what} timed out after {timeout_s:.0f} s on local rank {self.me}: "
                        f"local ranks {lagging} did not reach it. Make every local rank call the "
                        "same collectives in the same order, or raise timeout_s."
                    )
                for fd, _ in self._poll.poll(min(delay, left) * 1000):
                    j = self._pidfds.get(fd)
                    if j is not None:  # peer j exited: fatal if we still wait for it
                        self._exited(fd, j)
                        if ctrl[j * _WORDS + SEQ] < target:
                            self._lost(j, what)
                delay = min(delay * 2, _MAX_SLEEP_S)
        finally:
            ctrl[flag] = 0

    def _exited(self, fd: int, j: int) -> None:
        self._poll.unregister(fd)  # a pidfd stays readable: stop polling it
        os.close(fd)
        del self._pidfds[fd]
        self._dead.add(j)

    def _check_peers(self, lagging: list[int], what: str) -> None:
        for j in lagging:
            if j in self._dead:
                self._lost(j, what)
            if self.ctrl[j * _WORDS + CLOSED]:
                raise RingError(
                    f"{what} on {self._who(self.me)} cannot complete: {self._who(j)} closed "
                    "the shared-memory group. Call close() on every local rank only after the "
                    "last collective."
                )
            if j not in self._watched and not _alive(self.pids[j]):
                self._lost(j, what)

    def _who(self, j: int) -> str:
        """Local rank ``j`` as a user knows it: its rank, and which local rank that is."""
        if self.ranks is None:
            return f"local rank {j}"
        return f"rank {self.ranks[j]} (local rank {j} on this host)"

    def _lost(self, j: int, what: str) -> None:
        theirs = "its" if self.ranks is None else f"rank {self.ranks[j]}'s"
        raise RingError(
            f"lost {self._who(j)}, pid {self.pids[j]}: it exited while {self._who(self.me)} "
            f"waited for it in {what}. The job must restart the lost rank (or the whole "
            f"group); {theirs} log says why it died."
        )

    def close(self) -> None:
        """Tell the peers this rank left, wake them, and release the sockets and pidfds."""
        self.ctrl[self.me * _WORDS + CLOSED] = 1
        for j in self.peers:
            self._send(j)
        for fd in self._pidfds:
            os.close(fd)
        self._pidfds.clear()
        for s in self.senders.values():
            s.close()
        self.sock.close()
