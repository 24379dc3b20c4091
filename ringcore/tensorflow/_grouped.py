"""``grouped_allgather`` and ``grouped_reducescatter``: a list of tensors, each one
through the single-tensor op (with its gradient), under names derived from one."""

from __future__ import annotations

from typing import Any

from .._ops import ReduceOp
from ..runtime.process_sets import ProcessSet, global_process_set
from ._collectives import allgather, reducescatter
from ._compression import Compression

__all__ = ["grouped_allgather", "grouped_reducescatter"]


def _names(name: str | None, count: int) -> list[str | None]:
    return [None if name is None else f"{name}.{i}" for i in range(count)]


def _check_list(tensors: Any, what: str) -> list[Any]:
    if not isinstance(tensors, list | tuple) or not tensors:
        raise TypeError(f"{what} takes a non-empty list of tensors, got {type(tensors).__name__}")
    return list(tensors)


def grouped_allgather(
    tensors, name=None, ignore_name_scope=False, process_set: ProcessSet = global_process_set
) -> list[Any]:
    """``allgather`` of each tensor of the list (first dimensions may differ per rank)."""
    tensors = _check_list(tensors, "grouped_allgather")
    return [
        allgather(t, name=n, process_set=process_set)
        for t, n in zip(tensors, _names(name, len(tensors)), strict=True)
    ]


def grouped_reducescatter(
    tensors,
    device_dense="",
    compression=Compression.none,
    op=ReduceOp.Average,
    name=None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
) -> list[Any]:
    """``reducescatter`` of each tensor of the list; this rank's slices, in order."""
    tensors = _check_list(tensors, "grouped_reducescatter")
    return [
        reducescatter(
            t,
            compression=compression,
            op=op,
            name=n,
            process_set=process_set,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
        )
        for t, n in zip(tensors, _names(name, len(tensors)), strict=True)
    ]
