"""Process sets: subsets of ranks that run collectives among themselves.

``ProcessSet(ranks)`` objects are registered at ``init(process_sets=[...])`` or, with
dynamic process sets (``init(process_sets="dynamic")`` or
``RING_DYNAMIC_PROCESS_SETS=1``), by ``add_process_set`` on every rank. Each set
gets its own backend group; every collective takes ``process_set=``.
"""

from __future__ import annotations

from typing import Any

from .._ops import OpKind
from ..engine.handle import Handle
from ..engine.protocol import Request
from . import state as _state

__all__ = [
    "ProcessSet",
    "add_process_set",
    "check_process_set",
    "global_process_set",
    "register_process_set",
    "remove_process_set",
]


class ProcessSet:
    def __init__(self, ranks: list[int] | Any | None = None):
        if ranks is not None and not isinstance(ranks, list | tuple | range):
            # an mpi4py communicator: its ranks in COMM_WORLD
            ranks = _ranks_of_comm(ranks)
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)
        if self.ranks is not None and len(set(self.ranks)) != len(self.ranks):
            raise ValueError(f"ProcessSet ranks {self.ranks} repeat a rank")
        self.process_set_id: int | None = 0 if ranks is None else None

    def _members(self) -> list[int]:
        return list(range(_state.size())) if self.ranks is None else self.ranks

    def size(self) -> int:
        return len(self._members())

    def rank(self) -> int:
        """This process's rank within the set (-1 when it is not a member)."""
        members, me = self._members(), _state.rank()
        return members.index(me) if me in members else -1

    def included(self) -> bool:
        return self.rank() >= 0

    def __repr__(self) -> str:
        return (
            "ProcessSet(global)"
            if self.ranks is None
            else f"ProcessSet({self.ranks}, id={self.process_set_id})"
        )


def _ranks_of_comm(comm: Any) -> list[int]:
    from mpi4py import MPI

    world = MPI.COMM_WORLD.Get_group()
    return list(MPI.Group.Translate_ranks(comm.Get_group(), list(range(comm.Get_size())), world))


global_process_set = ProcessSet()


def check_process_set(process_set: ProcessSet | None, what: str = "this op") -> int:
    """The set's id, after checking that it is registered and this rank is in it."""
    ps = process_set if process_set is not None else global_process_set
    if not isinstance(ps, ProcessSet):
        raise TypeError(f"process_set must be a ProcessSet, got {type(ps).__name__}")
    if ps.process_set_id is None:
        raise ValueError(
            f"{ps!r} is not registered; pass it to init(process_sets=[...]) or call "
            "add_process_set() on every rank (with dynamic process sets enabled)."
        )
    if ps.ranks is not None and _state.rank() not in ps.ranks:
        raise ValueError(f"rank {_state.rank()} is not in {ps!r}, so it cannot run {what} on it")
    return ps.process_set_id


def register_process_set(ps: ProcessSet | list[int]) -> ProcessSet:
    """Create the set's backend group on every rank (a collective: every rank calls it,
    in the same order) and give it an id."""
    size = _state.size
    ps = ps if isinstance(ps, ProcessSet) else ProcessSet(list(ps))
    if ps.ranks is None:
        return global_process_set
    bad = [r for r in ps.ranks if not 0 <= r < size()]
    if bad or not ps.ranks:
        raise ValueError(f"{ps!r}: ranks must be non-empty and in [0, {size()}), got {ps.ranks}")
    ps.process_set_id = int(_control_op(OpKind.PS_ADD, ranks=tuple(ps.ranks)))
    return ps


def add_process_set(process_set: ProcessSet | list[int]) -> ProcessSet:
    """Register a new process set after init(); needs dynamic process sets
    (``init(process_sets="dynamic")`` or ``RING_DYNAMIC_PROCESS_SETS=1``)."""
    if not _state.dynamic_process_sets_enabled():
        raise ValueError(
            "add_process_set needs dynamic process sets: call init(process_sets='dynamic') or set "
            "RING_DYNAMIC_PROCESS_SETS=1 (or list the sets in init(process_sets=[...]))."
        )
    return register_process_set(process_set)


def remove_process_set(process_set: ProcessSet) -> bool:
    """Remove a registered set on every rank (a collective). Returns False for the global set."""
    if process_set.ranks is None or process_set.process_set_id in (None, 0):
        return False
    if not _state.dynamic_process_sets_enabled():
        raise ValueError(
            "remove_process_set needs dynamic process sets (init(process_sets='dynamic'))."
        )
    _control_op(OpKind.PS_REMOVE, set_id=process_set.process_set_id)
    process_set.process_set_id = None
    return True


def _control_op(kind: OpKind, **fields: Any) -> Any:
    """Run a process-set change through the engine, so every rank applies it at the
    same point of the op order; returns its result."""
    eng = _state.engine()
    name = eng.auto_name(kind)
    handle = eng.submit(Handle(name, kind), Request(name, kind, **fields))
    _state.wait_handle(handle)
    if handle.error is not None:
        raise handle.error
    return handle.result
