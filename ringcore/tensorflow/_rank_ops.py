"""The topology as TensorFlow ops (``rank_op()`` and co., as Horovod offers them):
int32 scalars, usable inside a graph as in eager mode."""

from __future__ import annotations

from typing import Any

from ..runtime import state as _state
from ..runtime.process_sets import ProcessSet, global_process_set
from ._bridge import tf

__all__ = [
    "local_rank_op",
    "local_size_op",
    "process_set_included_op",
    "rank_op",
    "size_op",
]


def _constant(value: int, name: str | None) -> Any:
    return tf.constant(value, dtype=tf.int32, name=name)


def rank_op(name: str | None = None) -> Any:
    """This process's rank, as an int32 tensor."""
    return _constant(_state.rank(), name)


def local_rank_op(name: str | None = None) -> Any:
    """This process's rank on its host, as an int32 tensor."""
    return _constant(_state.local_rank(), name)


def size_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """The number of ranks (of the process set ``process_set_id``), as an int32 tensor."""
    return _constant(_process_set(process_set_id).size(), name)


def local_size_op(name: str | None = None) -> Any:
    """The number of ranks on this host, as an int32 tensor."""
    return _constant(_state.local_size(), name)


def process_set_included_op(process_set_id: int = 0, name: str | None = None) -> Any:
    """1 if this rank belongs to the process set ``process_set_id``, else 0 (int32)."""
    return _constant(int(_process_set(process_set_id).included()), name)


def _process_set(process_set_id: int) -> ProcessSet:
    if process_set_id != 0:
        raise ValueError(
            f"process_set_id={process_set_id}: these ops know the global process set (id 0) "
            "only; for another set use tf.constant(process_set.size()) or "
            "process_set.included()"
        )
    return global_process_set
