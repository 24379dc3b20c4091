"""The fast lane's proposals: when every rank of a one-host job may run a batch of ops
without asking the coordinator.

A caller that waits for its rank's queued ops (none sent to the coordinator yet, each
an allreduce) does not need rank 0 to order them: if every rank is, at this moment, waiting on the same batch with nothing
else in flight, each can run it at once through the shared-memory group, from its own
thread. That saves the requests to rank 0, the coordinator's wake-up and the response,
and the hand-off to and from the engine's thread: most of a small op's cost
(docs/architecture.md, "The fast lane"). A proposal names its batch by one int64 key
(``ringcore.engine.lane.batch_key`` of its ops' sorted keys: a cache id, or a digest of
the whole request for a name the coordinator has not cached).

**State** (int64 words of the segment). The header line holds one *proposal*: its id
``P``, the batch's key, a bit mask of the ranks that voted for it, and its state
(open, committed, aborted). Each rank's control line holds ``busy``: how many ops the
rank has sent to the coordinator and not yet run (a pending ``join`` counts), or
``GONE`` once it shut down or broke; only its own engine writes it.

**Rules.** Every change of the proposal is made holding ``flock`` on the rank's own
open file description of the segment: one mutex for the host's ranks, released by the
kernel if a rank dies holding it.

- *propose(key)* (a rank with nothing sent: ``busy == 0``): if a proposal is open for
  the same batch, vote for it, and commit it when the vote is the last; if one is open
  for another batch, abort it (the ranks disagree on what runs next: the coordinator
  orders them); otherwise open a new one, but only while every rank's ``busy`` is 0.
- *busy going from 0 to 1* (any op sent to the coordinator, ``join``, shutdown)
  aborts an open proposal, under the lock: a rank with an op in flight
  through the coordinator must not see a peer skip the coordinator, or the two paths
  would run ops in different orders.
- A voter waits (spin, then sleeps that grow) until its proposal commits or aborts.
  A dead voter-to-be (its pid gone), one that shut down, or a wait over a second
  aborts it (the op then goes to the coordinator, whose stall inspector watches it).

**Why that is safe.** A proposal opens and gathers its votes only while no rank has an
op in flight through the coordinator (``busy`` is 0 everywhere, and a rank that submits
one aborts it first), so no response of the coordinator can be waiting to run on any
rank when it commits; ops submitted afterwards are answered only after every rank
submitted them, and each rank runs its committed op before any response it receives
from then on (the engine's execution lock). Once a rank went the coordinator's way for
an op (its proposal aborted), its ``busy`` stays above 0 until that op ran, so no peer
can open a proposal that would wait for a vote that never comes. A committed
proposal's voters all run its op; none can open the next proposal before every voter
joined that op's shared-memory rounds, so a waiter that finds another proposal's id in
the header knows its own was aborted.

**Across hosts** (the engine's host relay) a committed batch is not run by its voters
but sent to the coordinator by the rank whose vote committed it, and the engine threads
run it when the response comes; a voter may then look at the header only after its
peers ran the batch and opened the next proposal. With ``acks`` set (on every rank of the host alike),
each voter writes the id of the commit it saw in its own control line (``ACK``), and no
proposal opens while a voter of the committed one in the header has not: a waiter that
finds another id there still knows its own was aborted.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import time

from .sync import _alive

__all__ = ["GONE", "Votes"]

# header words (0-3: magic, version, local_size, slot_bytes)
H_ID, H_CID, H_VOTERS, H_STATE = 4, 5, 6, 7
NONE, OPEN, COMMITTED, ABORTED = 0, 1, 2, 3
BUSY = 4  # word of a rank's control line
ACK = 5  # word of a rank's control line: the last committed proposal it saw (``acks``)
GONE = 1 << 40  # busy of a rank that shut down: no proposal opens again
_WORDS = 8
_SPIN_S = 200e-6
#: the most ranks a proposal's voter mask holds (one int64)
MAX_RANKS = 62


class Votes:
    """This rank's view of the host's proposals (``header``/``ctrl``: ``"q"`` views)."""

    def __init__(
        self,
        header: memoryview,
        ctrl: memoryview,
        me: int,
        size: int,
        lock_fd: int,
        pids: dict[int, int],
    ):
        if size > MAX_RANKS:
            raise ValueError(f"the fast lane holds at most {MAX_RANKS} local ranks, got {size}")
        self.hdr, self.ctrl, self.me, self.size = header, ctrl, me, size
        self.lock_fd = lock_fd
        self._thread_lock = threading.Lock()
        self.pids = pids
        self.bit = 1 << me
        self.all = (1 << size) - 1
        self._busy_at = [j * _WORDS + BUSY for j in range(size)]
        self._ack_at = [j * _WORDS + ACK for j in range(size)]
        #: set on every rank of a host alike (the engine's host relay): a committed
        #: proposal blocks the next one until each of its voters has seen it commit
        self.acks = False
        #: the last proposal this rank's own vote committed (the host relay's sender)
        self.committed_here = 0
        #: proposals this rank committed / saw aborted (tests and bench read it)
        self.stats = {"committed": 0, "aborted": 0, "opened": 0}

    # -- the lock --------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self):
        """The host's mutex: ``flock`` excludes the other ranks (their own open file
        descriptions), the thread lock this rank's other threads (``flock`` on one
        description does not exclude threads sharing it)."""
        with self._thread_lock:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)

    def _abort_open(self) -> None:
        """Abort the open proposal, if one is (the lock is held)."""
        if self.hdr[H_STATE] == OPEN:
            self.hdr[H_STATE] = ABORTED

    # -- this rank's load ----------------------------------------------------------------
    def set_busy(self, n: int) -> None:
        """Publish how many ops this rank has in flight through the coordinator; from 0 to
        more, abort an open proposal first (see the module's rules)."""
        at = self._busy_at[self.me]
        n = max(0, n)
        if self.ctrl[at] >= GONE:
            return  # left: stays so
        if n and not self.ctrl[at]:
            with self._locked():
                self.ctrl[at] = n
                self._abort_open()
            return
        self.ctrl[at] = n

    def leave(self) -> None:
        """This rank shuts down: no proposal opens again, an open one aborts."""
        with self._locked():
            self.ctrl[self._busy_at[self.me]] = GONE
            self._abort_open()

    # -- proposals -----------------------------------------------------------------------
    def propose(self, cid: int) -> int | None:
        """Vote to run the batch named ``cid`` (a key) now (this rank has sent nothing).
        The proposal's id to :meth:`wait` on, or None: take the coordinator's path."""
        hdr = self.hdr
        with self._locked():
            if hdr[H_STATE] == OPEN:
                if hdr[H_CID] != cid or hdr[H_VOTERS] & self.bit:
                    hdr[H_STATE] = ABORTED  # the ranks disagree on the next op
                    self.stats["aborted"] += 1
                    return None
                voters = hdr[H_VOTERS] | self.bit
                hdr[H_VOTERS] = voters
                if voters == self.all:
                    hdr[H_STATE] = COMMITTED
                    self.committed_here = int(hdr[H_ID])
                return int(hdr[H_ID])
            if any(self.ctrl[at] for at in self._busy_at):
                return None  # some rank has ops in flight through the coordinator
            if self.acks and hdr[H_STATE] == COMMITTED and not self._all_acked():
                return None  # a voter of the last commit has not seen it yet
            pid = int(hdr[H_ID]) + 1
            hdr[H_CID], hdr[H_VOTERS] = cid, self.bit
            hdr[H_ID] = pid
            hdr[H_STATE] = OPEN
            self.stats["opened"] += 1
            return pid

    def _outcome(self, pid: int) -> bool | None:
        """True: committed; False: aborted; None: still open."""
        if self.hdr[H_ID] != pid:
            return False  # another proposal opened: ours was aborted (module docstring)
        state = self.hdr[H_STATE]
        return None if state == OPEN else state == COMMITTED

    def wait(self, pid: int, give_up_s: float = 1.0) -> bool:
        """Whether proposal ``pid`` committed (run the op now) or aborted (take the
        coordinator's path). Spins briefly, then sleeps ever longer (at most 5 ms) and
        checks that the ranks it waits for live. After ``give_up_s`` it aborts the
        proposal itself: a rank that is that late makes the fast lane pointless for this
        op, and the coordinator's stall inspector watches the op from then on."""
        t0 = time.perf_counter()
        spin_end = t0 + _SPIN_S
        while time.perf_counter() < spin_end:
            out = self._outcome(pid)
            if out is not None:
                return self._count(out, pid)
            os.sched_yield()  # a full 2-core host: let the rank we wait for run
        delay, next_check, end = 50e-6, t0 + 0.02, t0 + give_up_s
        while True:
            out = self._outcome(pid)
            if out is not None:
                return self._count(out, pid)
            now = time.perf_counter()
            if now >= next_check:
                next_check = now + 0.02
                if now >= end or self._missing_voter_gone():
                    with self._locked():
                        if self._outcome(pid) is None:
                            self.hdr[H_STATE] = ABORTED
                    continue
            time.sleep(delay)
            delay = min(delay * 2, 0.005)

    def _count(self, committed: bool, pid: int) -> bool:
        self.stats["committed" if committed else "aborted"] += 1
        if committed and self.acks:
            self.ctrl[self._ack_at[self.me]] = pid  # this rank's own word: no lock
        return committed

    def _all_acked(self) -> bool:
        """Every voter of the committed proposal in the header has seen it commit (the
        lock is held). Without this rule a voter slower to look than its peers are to
        run the op and open the next proposal would find another id in the header and
        take its committed batch for aborted (``acks``)."""
        pid, voters = self.hdr[H_ID], self.hdr[H_VOTERS]
        return all(self.ctrl[self._ack_at[j]] == pid for j in range(self.size) if voters & (1 << j))

    def _missing(self) -> list[int]:
        voters = self.hdr[H_VOTERS]
        return [j for j in range(self.size) if not voters & (1 << j)]

    def _missing_voter_gone(self) -> bool:
        for j in self._missing():
            if self.ctrl[self._busy_at[j]] >= GONE or not _alive(self.pids[j]):
                return True
        return False
