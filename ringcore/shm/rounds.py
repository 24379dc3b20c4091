"""The round machinery of :class:`ringcore.shm.group.ShmGroup`: banks, descriptors, barriers.

A *round* is one use of a bank: every rank writes (its descriptor on an op's first
round, and its data), then passes a barrier, then reads. Rounds alternate between the
segment's two banks; see ``ringcore.shm.group`` for why no trailing barrier is needed.
"""

from __future__ import annotations

import contextlib
import os
from array import array
from collections.abc import Sequence
from typing import Any

import torch

from .._errors import RingError
from .._ops import OpKind
from .reduce import NUMEL, SPLITS_AT, Descriptor
from .segment import BANKS, Mapping
from .sync import Sync
from .vote import MAX_RANKS, Votes

__all__ = ["Rounds"]


class Rounds:
    """The mapped segment of one rank and the rounds it takes part in."""

    def __init__(
        self,
        mapping: Mapping,
        local_rank: int,
        timeout_s: float,
        ranks: Sequence[int] | None = None,
    ):
        layout = self.layout = mapping.layout
        self.local_rank, self.local_size = local_rank, layout.local_size
        self.timeout_s = timeout_s
        self._mm = mapping.mm
        view = memoryview(self._mm)
        self._ctrl = view[layout.ctrl_offset : layout.meta_offset].cast("q")
        words = BANKS * layout.local_size * layout.meta_words
        self._meta = view[layout.meta_offset : layout.meta_offset + 8 * words].cast("q")
        self._hdr = view[:64].cast("q")
        view.release()
        self._sync = Sync(
            self._ctrl, local_rank, layout.local_size, mapping.sock, mapping.senders, ranks
        )
        self._lock_fd = mapping.lock_fd
        #: the fast lane's proposals (``vote``); None where they cannot work
        self.votes: Votes | None = None
        if mapping.lock_fd >= 0 and layout.local_size <= MAX_RANKS:
            self.votes = Votes(
                self._hdr,
                self._ctrl,
                local_rank,
                layout.local_size,
                mapping.lock_fd,
                self._sync.pids,
            )
        data = torch.frombuffer(
            self._mm, dtype=torch.uint8, count=BANKS * layout.bank_bytes, offset=layout.data_offset
        )
        self._banks = [data[b * layout.bank_bytes : (b + 1) * layout.bank_bytes] for b in range(2)]
        self._typed: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
        self._rounds = 0
        self._mw, self._nread = layout.meta_words, SPLITS_AT + layout.local_size
        self._broken: str | None = None
        self._closed = False

    # ---- rounds -------------------------------------------------------------------------

    def _begin(self, words: list[int] | None) -> int:
        """Start a round: its bank, with this rank's descriptor written when ``words``."""
        if self._closed:
            raise RingError("the shared-memory group is closed; create a new one")
        if self._broken is not None:
            raise RingError(
                f"the shared-memory group is broken by an earlier failure: {self._broken}"
            )
        bank = self._rounds % BANKS
        self._rounds += 1
        if words is not None:
            at = (bank * self.local_size + self.local_rank) * self._mw
            if len(words) < self._nread:  # clear the splits words an alltoall left
                words = words + [0] * (self._nread - len(words))
            self._meta[at : at + self._nread] = array("q", words)
        return bank

    def _barrier(self, what: str) -> None:
        try:
            self._sync.barrier(what, self.timeout_s)
        except RingError as exc:
            self._broken = str(exc)
            raise

    def _exchange(self, what: str, bank: int) -> list[list[int]]:
        """Barrier, then every rank's descriptor of this round, checked to agree."""
        self._barrier(what)
        mw, n = self._mw, self._nread
        at = bank * self.local_size * mw
        all_words = [
            self._meta[at + r * mw : at + r * mw + n].tolist() for r in range(self.local_size)
        ]
        Descriptor.check(all_words)
        return all_words

    def _slots(self, bank: int, dtype: torch.dtype) -> list[torch.Tensor]:
        views = self._typed.get((bank, dtype))
        if views is None:
            s = self.layout.slot_bytes
            raw = self._banks[bank]
            views = [raw[j * s : (j + 1) * s].view(dtype) for j in range(self.local_size)]
            self._typed[(bank, dtype)] = views
        return views

    def _pull(self, what: str, raw: torch.Tensor, words: list[int], layout: Any) -> Any:
        """Publish ``raw`` in rounds of a slot; each rank copies, from every rank j, bytes
        ``[start, end)`` of j's buffer to ``dst`` of its output, as ``layout`` says."""
        nb, s, me = raw.numel(), self.layout.slot_bytes, self.local_rank
        bank = self._begin(words)
        self._slots(bank, torch.uint8)[me][: min(s, nb)].copy_(raw[:s])
        all_words = self._exchange(what, bank)
        out, ranges = layout(all_words)
        dst = out.view(-1).view(torch.uint8)
        total = max(w[NUMEL] for w in all_words) * out.element_size()
        for k in range(max(1, -(-total // s))):
            if k:
                bank = self._begin(None)
                lo = min(nb, k * s)
                self._slots(bank, torch.uint8)[me][: min(nb, lo + s) - lo].copy_(raw[lo : lo + s])
                self._barrier(what)
            slots, w0 = self._slots(bank, torch.uint8), k * s
            for j, (start, end, at) in enumerate(ranges):
                a, b = max(start, w0), min(end, w0 + s)
                if a < b:
                    dst[at + a - start : at + b - start].copy_(slots[j][a - w0 : b - w0])
        return out, all_words

    def barrier(self) -> None:
        """Return once every local rank has called it."""
        bank = self._begin(Descriptor.words(OpKind.BARRIER, None))
        self._exchange(OpKind.BARRIER, bank)

    def close(self) -> None:
        """Leave the group: peers waiting on this rank fail fast; the segment is unmapped."""
        if self._closed:
            return
        self._closed = True
        self._sync.close()
        self._typed.clear()
        self._banks.clear()
        self.votes = None
        self._ctrl.release()
        self._meta.release()
        self._hdr.release()
        if self._lock_fd >= 0:
            os.close(self._lock_fd)
            self._lock_fd = -1
        with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it later
            self._mm.close()
