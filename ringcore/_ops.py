"""What an op is: its kind (:class:`OpKind`, the one list every room compares kinds by)
and its reduction operator, named as Horovod names them (``hvd.Average``, ``hvd.Sum``)."""

from __future__ import annotations

import enum

__all__ = [
    "CONTROL_KINDS",
    "Adasum",
    "Average",
    "Max",
    "Min",
    "OpKind",
    "Product",
    "ReduceOp",
    "Sum",
    "resolve_op",
]


class OpKind(str, enum.Enum):
    """The kind of an op: of a request a rank submits, of a response item every rank runs,
    of a shared-memory round. ``JOIN`` (the end of a ``join()``) and ``ERROR`` (an error
    for the item's entries) come only in responses; ``PS_ADD`` and ``PS_REMOVE`` are
    process-set changes, which every rank of the job applies. The values are what the
    wire carries; ``str()`` and formatting give the value on every Python version.

    Reading a member off the class costs ~60 ns on Python 3.11 (the enum metaclass's
    ``__getattr__``): per-op code binds the members it compares to module names once."""

    ALLREDUCE = "allreduce"
    ALLGATHER = "allgather"
    BROADCAST = "broadcast"
    ALLTOALL = "alltoall"
    REDUCESCATTER = "reducescatter"
    BARRIER = "barrier"
    PS_ADD = "ps_add"
    PS_REMOVE = "ps_remove"
    JOIN = "join"
    ERROR = "error"

    # the value, whatever the Python version (3.12 changed a mixed-in enum's format);
    # str's own slots: an f-string of a kind costs what one of a str does
    __str__ = str.__str__
    __format__ = str.__format__  # type: ignore[assignment]


#: the process-set changes: every rank of the job runs them, whatever the set
CONTROL_KINDS = frozenset((OpKind.PS_ADD, OpKind.PS_REMOVE))


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
