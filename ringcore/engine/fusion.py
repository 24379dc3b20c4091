"""Tensor fusion's one rule, shared by the coordinator and the fast lane: which
allreduces go into one buffer, counted in bytes against the fusion threshold."""

from __future__ import annotations

from dataclasses import dataclass, field

from .._ops import OpKind
from .protocol import Entry, Request, ResponseItem

__all__ = ["ITEMSIZE", "Fusion", "FusionBuckets", "nbytes"]


#: bytes per element of each dtype the protocol names (unknown ones count 8)
ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "int32": 4,
    "int64": 8,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """The bytes of a tensor of ``dtype`` (as the protocol names it) and ``shape``: what
    fusion counts against the threshold, on the coordinator and in the fast lane."""
    n = ITEMSIZE.get(dtype, 8)
    for d in shape:
        n *= d
    return n


@dataclass(eq=False)
class Fusion:
    """An allreduce response item being filled: ops of one dtype/op/scale/device (or one
    group), in the order they were placed."""

    req: Request
    process_set: int
    entries: list[Entry] = field(default_factory=list)

    def item(self) -> ResponseItem:
        r = self.req
        return ResponseItem(
            OpKind.ALLREDUCE,
            self.process_set,
            r.dtype,
            tuple(self.entries),
            op=r.op,
            prescale=r.prescale,
            postscale=r.postscale,
            device=r.device,  # a joined rank makes its zeros on this device type
        )


class FusionBuckets:
    """Which fusion an allreduce joins, by the one rule of the coordinator and the fast
    lane: each signature has one open fusion, and a new one opens when the next op would
    take it past ``threshold`` bytes (an op larger than that is a fusion of its own)."""

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold
        self.fusions: list[Fusion] = []
        self._open: dict[tuple, tuple[Fusion, int]] = {}

    def place(self, sig: tuple, req: Request, process_set: int) -> tuple[Fusion, bool]:
        """The fusion ``req`` joins (the caller appends its entry), and whether it is new."""
        size = nbytes(req.dtype, req.shape)
        fusion, used = self._open.get(sig) or (None, 0)
        fresh = fusion is None or used + size > self.threshold
        if fusion is None or fresh:
            fusion, used = Fusion(req, process_set), 0
            self.fusions.append(fusion)
        self._open[sig] = (fusion, used + size)
        return fusion, fresh
