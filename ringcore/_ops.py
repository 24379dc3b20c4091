"""Reduction operators, named as Horovod names them (``hvd.Average``, ``hvd.Sum``, ...)."""

from __future__ import annotations

import enum

__all__ = ["Adasum", "Average", "Max", "Min", "Product", "ReduceOp", "Sum", "resolve_op"]


class ReduceOp(enum.IntEnum):
    Average = 0
    Sum = 1
    Adasum = 2
    Min = 3
    Max = 4
    Product = 5


Average = ReduceOp.Average
Sum = ReduceOp.Sum
Adasum = ReduceOp.Adasum
Min = ReduceOp.Min
Max = ReduceOp.Max
Product = ReduceOp.Product


def resolve_op(average: bool | None, op: ReduceOp | int | None) -> ReduceOp:
    """Horovod's rule: ``average`` (deprecated) and ``op`` are exclusive; default Average."""
    if type(op) is ReduceOp and average is None:  # the common call, once per op
        return op
    if average is not None and op is not None:
        raise ValueError(
            f"allreduce got both average={average!r} and op={op!r}; pass only op= "
            "(average= is Horovod's deprecated spelling)."
        )
    if op is None:
        return ReduceOp.Sum if average is False else ReduceOp.Average
    try:
        return ReduceOp(int(op))
    except ValueError:
        names = ", ".join(m.name for m in ReduceOp)
        raise ValueError(f"op={op!r} is not a reduce operator; use one of {names}.") from None
