"""Collectives between the ranks of one host through a shared-memory segment.

:class:`ShmGroup` is a data plane for the local ranks of a host (several Spark
executors' tasks or Ray workers on one machine): tensors travel through
``/dev/shm`` instead of loopback TCP. Pure Python over ``mmap``, ``torch`` views of
the segment (``torch.frombuffer``) and a few syscalls; no compiled code.

- **Segment** (``segment``, ``files``, ``handshake``): local rank 0
  creates it and names it in the store (signed with the job's secret); every other
  rank checks that name and the file (ours, mode 0600, not a link) before it maps it;
  all confirm through the store, and the name is unlinked as soon as every rank has
  mapped it, so a rank killed after that leaves nothing in ``/dev/shm``. A rank that
  fails or times out during the handshake removes them; only when every rank holding
  them dies then (local rank 0 killed before the others opened the segment) do they
  stay, until the next group formed on the host sweeps them. Without room there (``os.statvfs``; Docker gives 64 MB), or when any
  local rank cannot open, check or map the segment, ``create`` logs one warning
  naming the cause and returns None on every local rank: the caller keeps the
  network path. ``RING_SHM=0`` disables it.
- **Barriers** (``sync``): per-rank sequence counters in the segment, a short
  spin, then a blocking ``poll`` on a wake-up socket (bound in a private folder, then
  unnamed: no other process can reach it; an idle rank burns no core),
  and pidfds of the peers, so a dying rank fails the others at once with a
  :class:`RingError` naming it.
- **Data**: two banks of L slots of ``slot_bytes``; round k of any op uses bank
  ``k % 2``. A rank writes a bank only after the barrier of the following round,
  which every rank passes only after reading the bank's previous contents: no
  trailing barrier is needed. Each op's first round also carries a descriptor
  (kind, op, root, dtype, shape, splits) that every rank checks after the first
  barrier, so disagreeing ranks all raise :class:`CollectiveMismatchError` before
  any data is read (writes never exceed a rank's own slot).
- **allreduce**: per chunk of a slot, each rank writes its (prescaled) input into
  its slot; barrier; each rank reduces its own 1/L slice across the slots
  (reduce-scatter: the work is shared) and applies Average/postscale; barrier;
  every rank copies the L reduced slices out (allgather). Up to ``small_bytes``
  (64 KiB) every rank instead reduces the whole tensor itself, in the same order (so
  the ranks' results are bit-identical): one barrier instead of two, where the
  barrier, not the arithmetic, is the cost.
  **reducescatter** is the first half with the slices given by Horovod's split of
  the first dimension (the first ``n % L`` ranks get one more row): one barrier per
  chunk. **allgather**, **alltoall** and **broadcast** publish bytes in rounds and
  each rank pulls what it needs: one barrier per round.

Slots default to 1 MiB (the best of 256 KiB .. 4 MiB for a 16 MB allreduce here:
chunks stay in the shared L3): the segment of 2 ranks takes 4 MiB, of 8 ranks 16 MiB.
``prefix`` must be unique per group (its store keys are not reused).

Reduce operators: :mod:`ringcore._ops` members, or names as strings (``"sum"``).
Every ``ShmGroup`` method must be called by every local rank in the same order.
Argument errors (a non-contiguous tensor, bad splits) raise ``ValueError`` on the
rank that made them, before it touches the segment.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Sequence
from typing import Any

import torch

from .._ops import OpKind, ReduceOp
from .handshake import map_segment
from .reduce import DIM0, NUMEL, SPLITS_AT, Descriptor, finish_, reduce_into_, resolve
from .reduce import write_scaled_ as _write_scaled
from .rounds import Rounds
from .segment import DEFAULT_SLOT_BYTES, Layout, free_bytes, shm_enabled
from .sync import ordering_supported

_ALLREDUCE, _REDUCESCATTER, _BROADCAST = OpKind.ALLREDUCE, OpKind.REDUCESCATTER, OpKind.BROADCAST
_ALLGATHER, _ALLTOALL = OpKind.ALLGATHER, OpKind.ALLTOALL

__all__ = ["DEFAULT_SLOT_BYTES", "ShmGroup", "shm_enabled"]

log = logging.getLogger("ringtrain.ringcore.shm")


def _split(n: int, parts: int, unit: int) -> list[tuple[int, int]]:
    """``[0, n)`` in ``parts`` ranges, each a multiple of ``unit`` long (64-byte aligned)."""
    step = -(-n // parts)
    step = -(-step // unit) * unit
    return [(min(n, i * step), min(n, (i + 1) * step)) for i in range(parts)]


def _flat(tensor: Any, what: str) -> torch.Tensor:
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
        raise ValueError(f"{what} takes a CPU torch.Tensor, got {type(tensor).__name__}")
    if not tensor.is_contiguous():
        raise ValueError(f"{what} needs a contiguous tensor; pass tensor.contiguous()")
    return tensor.view(-1)


def _bytes(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def _rows(tensor: torch.Tensor, what: str) -> int:
    if tensor.dim() == 0:
        raise ValueError(f"{what} needs a tensor with a first dimension; got a 0-d tensor")
    return tensor.shape[0]


def _bounds(ts: list[torch.Tensor], what: str) -> tuple[list[tuple[int, int, torch.Tensor]], int]:
    """Each tensor's [start, end) in the concatenation of ``ts`` (flat views), and its length."""
    out, at = [], 0
    for t in ts:
        flat = _flat(t, what)
        out.append((at, at + flat.numel(), flat))
        at += flat.numel()
    return out, at


def _pieces(bounds: list[tuple[int, int, torch.Tensor]], lo: int, hi: int):
    """The parts of the tensors in ``bounds`` within [lo, hi) of the concatenation: (start,
    end, the view of that part), in order."""
    for start, end, t in bounds:
        if end <= lo:
            continue
        if start >= hi:
            break
        a, b = max(start, lo), min(end, hi)
        yield a, b, t[a - start : b - start]


class ShmGroup(Rounds):
    """The local ranks of one host, joined through one shared-memory segment.

    Made by :meth:`create`. Seams for tests: ``shm_dir`` and ``free_space`` (the size
    check) are class attributes."""

    shm_dir = "/dev/shm"
    free_space = staticmethod(free_bytes)
    small_bytes = 64 << 10  # allreduce up to this size: one barrier, redundant reduction

    @classmethod
    def create(
        cls,
        store: Any,
        prefix: str,
        local_rank: int,
        local_size: int,
        *,
        timeout_s: float,
        slot_bytes: int = DEFAULT_SLOT_BYTES,
        ranks: Sequence[int] | None = None,
    ) -> ShmGroup | None:
        """Join the host's group (every local rank calls this); None: use the network.
        ``ranks``: each local rank's rank in the job (or group), in local order, which
        failures name."""
        if not 0 <= local_rank < local_size:
            raise ValueError(f"local_rank must be in [0, {local_size}), got {local_rank}")
        if not shm_enabled():
            log.debug("RING_SHM=0: the shared-memory data plane is off")
            return None
        if not ordering_supported():
            if local_rank == 0:
                log.warning(
                    "the shared-memory data plane relies on x86-64 memory ordering; on %s "
                    "the local ranks use the network path (set RING_SHM=0 to silence this).",
                    os.uname().machine,
                )
            return None
        mapping = map_segment(
            store,
            prefix,
            local_rank,
            Layout(local_size, slot_bytes),
            timeout_s=timeout_s,
            shm_dir=cls.shm_dir,
            free_space=cls.free_space,
        )
        if mapping is None:
            return None
        try:
            return cls(mapping, local_rank, timeout_s, ranks)
        except BaseException:
            mapping.close()
            raise

    # ---- collectives --------------------------------------------------------------------

    def allreduce_(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | int | str = ReduceOp.Sum,
        prescale: float = 1.0,
        postscale: float = 1.0,
    ) -> torch.Tensor:
        """Reduce ``tensor`` over the local ranks, in place; returns it.

        Up to ``small_bytes`` every rank reduces the whole (tiny) tensor itself, in the
        same order, so one barrier suffices; above, the reduce-scatter/allgather chunks."""
        flat = _flat(tensor, "allreduce_")
        rop = resolve(op, tensor.dtype)
        words = Descriptor.words(_ALLREDUCE, tensor, int(rop))
        at = [(0, flat.numel(), flat)]
        self._allreduce_concat(at, at, flat.numel(), tensor.dtype, rop, words, prescale, postscale)
        return tensor

    def allreduce_list_(
        self,
        srcs: list[torch.Tensor],
        dsts: list[torch.Tensor],
        op: ReduceOp | int | str = ReduceOp.Sum,
        prescale: float = 1.0,
        postscale: float = 1.0,
    ) -> None:
        """Reduce the concatenation of ``srcs`` (contiguous, one dtype) over the local
        ranks into ``dsts`` (the same sizes; a dst may be its src), with no flat copy of
        them: the segment's slot is the fusion buffer. Each chunk of the concatenation is
        written into this rank's slot piece by piece and read back likewise; the rounds,
        chunks and arithmetic are those of :meth:`allreduce_` on the concatenation, so
        the results are the same bits."""
        src_at, n = _bounds(srcs, "allreduce_list_")
        dst_at, m = _bounds(dsts, "allreduce_list_")
        if m != n or any(d.dtype != srcs[0].dtype for d in dsts):
            raise ValueError("allreduce_list_ needs dsts of the srcs' sizes and dtype")
        dtype = srcs[0].dtype
        rop = resolve(op, dtype)
        words = Descriptor.words(
            _ALLREDUCE, torch.empty((n,), dtype=dtype, device="meta"), int(rop)
        )
        self._allreduce_concat(src_at, dst_at, n, dtype, rop, words, prescale, postscale)

    def _allreduce_concat(
        self,
        src_at: list[tuple[int, int, torch.Tensor]],
        dst_at: list[tuple[int, int, torch.Tensor]],
        n: int,
        dtype: torch.dtype,
        rop: ReduceOp,
        words: list[int] | None,
        prescale: float,
        postscale: float,
    ) -> None:
        """The allreduce of the ``n`` elements that ``src_at`` (see :func:`_bounds`) lays
        end to end, written to the places of ``dst_at``."""
        size, me, item = self.local_size, self.local_rank, dtype.itemsize
        per = self.layout.slot_bytes // item
        if n * item <= self.small_bytes and n <= per:
            bank = self._begin(words)
            slots = self._slots(bank, dtype)
            for a, b, v in _pieces(src_at, 0, n):
                _write_scaled(slots[me][a:b], v, prescale)
            self._exchange(_ALLREDUCE, bank)
            for a, b, d in _pieces(dst_at, 0, n):
                d.copy_(slots[0][a:b])
                for j in range(1, size):
                    reduce_into_(d, slots[j][a:b], rop)
                finish_(d, rop, size, postscale)
            return
        for lo in range(0, max(n, 1), per):
            hi = min(n, lo + per)
            bank = self._begin(words)
            slots = self._slots(bank, dtype)
            for a, b, v in _pieces(src_at, lo, hi):
                _write_scaled(slots[me][a - lo : b - lo], v, prescale)
            if words is not None:
                self._exchange(_ALLREDUCE, bank)
            else:
                self._barrier(_ALLREDUCE)
            words = None
            ranges = _split(hi - lo, size, max(1, 64 // item))
            a, b = ranges[me]
            acc = slots[me][a:b]
            for j in range(size):
                if j != me:
                    reduce_into_(acc, slots[j][a:b], rop)
            finish_(acc, rop, size, postscale)
            self._barrier(_ALLREDUCE)
            for j, (a, b) in enumerate(ranges):
                for x, y, d in _pieces(dst_at, lo + a, lo + b):
                    d.copy_(slots[j][x - lo : y - lo])

    def reducescatter(
        self,
        tensor: torch.Tensor,
        op: ReduceOp | int | str = ReduceOp.Sum,
        prescale: float = 1.0,
        postscale: float = 1.0,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """This rank's rows of the reduction (Horovod's split of the first dimension);
        ``out``: where to write them (contiguous, the dtype, this rank's rows' elements)."""
        flat = _flat(tensor, "reducescatter")
        rows, rop = _rows(tensor, "reducescatter"), resolve(op, tensor.dtype)
        words: list[int] | None = Descriptor.words(_REDUCESCATTER, tensor, int(rop))
        n, me, size = flat.numel(), self.local_rank, self.local_size
        base, extra = divmod(rows, size)
        start, mine = me * base + min(me, extra), base + (1 if me < extra else 0)
        row = math.prod(tensor.shape[1:])
        if out is None:
            out = torch.empty((mine, *tensor.shape[1:]), dtype=tensor.dtype)
        elif not out.is_contiguous() or out.dtype != tensor.dtype or out.numel() != mine * row:
            raise ValueError(
                f"reducescatter's out must be contiguous, of {tensor.dtype} and hold this "
                f"rank's {mine * row} elements; got {tuple(out.shape)} of {out.dtype}"
                f"{'' if out.is_contiguous() else ', not contiguous'}"
            )
        dst, lo_me = out.view(-1), start * row
        per = self.layout.slot_bytes // flat.element_size()
        for lo in range(0, max(n, 1), per):
            c = min(per, n - lo)
            bank = self._begin(words)
            slots = self._slots(bank, tensor.dtype)
            _write_scaled(slots[me][:c], flat[lo : lo + c], prescale)
            if words is not None:
                self._exchange(_REDUCESCATTER, bank)
                words = None
            else:
                self._barrier(_REDUCESCATTER)
            a, b = max(lo_me, lo), min(lo_me + mine * row, lo + c)
            if a < b:
                piece = dst[a - lo_me : b - lo_me]
                piece.copy_(slots[0][a - lo : b - lo])
                for j in range(1, size):
                    reduce_into_(piece, slots[j][a - lo : b - lo], rop)
        finish_(out, rop, size, postscale)
        return out

    def broadcast_(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """Overwrite ``tensor`` on every local rank with local rank ``root``'s; returns it."""
        if not 0 <= root < self.local_size:
            raise ValueError(f"root must be a local rank in [0, {self.local_size}), got {root}")
        raw = _bytes(_flat(tensor, "broadcast_"))
        words: list[int] | None = Descriptor.words(_BROADCAST, tensor, root=root)
        nb, step = raw.numel(), self.layout.bank_bytes
        for lo in range(0, max(nb, 1), step):
            c = min(step, nb - lo)
            bank = self._begin(words)
            if self.local_rank == root:
                self._banks[bank][:c].copy_(raw[lo : lo + c])
            if words is not None:
                self._exchange(_BROADCAST, bank)
                words = None
            else:
                self._barrier(_BROADCAST)
            if self.local_rank != root:
                raw[lo : lo + c].copy_(self._banks[bank][:c])
        return tensor

    def allgather(self, tensor: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's ``tensor`` concatenated along the first dimension (sizes may differ).
        ``out``: where to write it (contiguous, ``tensor``'s dtype, ``local_size`` times its
        elements: every rank's tensor must then have this rank's size), so that a caller
        with its own output buffer (FSDP2's all-gather) needs no second one."""
        raw = _bytes(_flat(tensor, "allgather"))
        _rows(tensor, "allgather")
        itemsize = tensor.element_size()
        if out is not None and (
            not out.is_contiguous()
            or out.dtype != tensor.dtype
            or out.numel() != tensor.numel() * self.local_size
        ):
            raise ValueError(
                f"allgather's out must be contiguous, of {tensor.dtype} and hold "
                f"{self.local_size} x {tensor.numel()} elements; got {tuple(out.shape)} of "
                f"{out.dtype}{'' if out.is_contiguous() else ', not contiguous'}"
            )

        def layout(all_words: list[list[int]]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
            dims = [w[DIM0] for w in all_words]
            sizes = [w[NUMEL] * itemsize for w in all_words]
            if out is None:
                dst = torch.empty((sum(dims), *tensor.shape[1:]), dtype=tensor.dtype)
            elif len(set(sizes)) != 1:  # every rank sees the same words: all raise here
                raise ValueError(
                    f"allgather into a given out needs one size on every rank; the local "
                    f"ranks' tensors hold {[w[NUMEL] for w in all_words]} elements"
                )
            else:
                dst = out
            offs = [sum(sizes[:j]) for j in range(len(sizes))]
            return dst, [(0, sizes[j], offs[j]) for j in range(len(sizes))]

        result, _ = self._pull(_ALLGATHER, raw, Descriptor.words(_ALLGATHER, tensor), layout)
        return result

    def alltoall(
        self, tensor: torch.Tensor, splits: Any = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Send ``splits[j]`` rows to local rank ``j``; returns (received rows, received splits)."""
        raw = _bytes(_flat(tensor, "alltoall"))
        rows, size, me = _rows(tensor, "alltoall"), self.local_size, self.local_rank
        send = self._splits(splits, rows)
        row_b = math.prod(tensor.shape[1:]) * tensor.element_size()
        words = Descriptor.words(_ALLTOALL, tensor)
        words[SPLITS_AT : SPLITS_AT + size] = send

        def layout(all_words: list[list[int]]) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
            recv = [w[SPLITS_AT + me] for w in all_words]
            out = torch.empty((sum(recv), *tensor.shape[1:]), dtype=tensor.dtype)
            ranges, dst = [], 0
            for j, w in enumerate(all_words):
                start = sum(w[SPLITS_AT : SPLITS_AT + me]) * row_b
                ranges.append((start, start + recv[j] * row_b, dst))
                dst += recv[j] * row_b
            return out, ranges

        out, all_words = self._pull(_ALLTOALL, raw, words, layout)
        return out, torch.tensor([w[SPLITS_AT + me] for w in all_words], dtype=torch.int64)

    def _splits(self, splits: Any, rows: int) -> list[int]:
        size = self.local_size
        if splits is None:
            if rows % size:
                raise ValueError(
                    f"alltoall without splits needs a first dimension divisible by the "
                    f"{size} local ranks, got {rows}; pass splits="
                )
            return [rows // size] * size
        send = [int(s) for s in (splits.tolist() if isinstance(splits, torch.Tensor) else splits)]
        if len(send) != size or min(send) < 0 or sum(send) != rows:
            raise ValueError(
                f"alltoall splits={send} must be {size} non-negative row counts summing to "
                f"the first dimension {rows}"
            )
        return send
