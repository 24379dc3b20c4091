"""Process sets: subsets of ranks that run collectives among themselves.

This first cut knows the global set only; ``ProcessSet(ranks)`` groups arrive with
the op engine.
"""

from __future__ import annotations

__all__ = ["ProcessSet", "check_process_set", "global_process_set"]


class ProcessSet:
    def __init__(self, ranks: list[int] | None = None):
        self.ranks = None if ranks is None else sorted(int(r) for r in ranks)

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self.ranks is None else f"ProcessSet({self.ranks})"


global_process_set = ProcessSet()


def check_process_set(process_set: ProcessSet | None) -> None:
    if process_set is None or process_set is global_process_set or process_set.ranks is None:
        return
    raise NotImplementedError(
        f"process_set={process_set!r}: only the global process set is supported so far; "
        "leave process_set at its default."
    )
