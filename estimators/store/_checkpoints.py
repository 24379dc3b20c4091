"""A fit's checkpoint as its framework loads it: the bytes of the run's newest whole one.

Who may write a run's checkpoint and which one a resume reads (claims, fencing at the
commit point, the fallback to ``checkpoint.pt.prev``) is the run-services layer's,
shared with ray_runner: :mod:`ringcore.runs.checkpoints`, reached through the store's
``claim_run`` / ``write_checkpoint`` / ``find_checkpoint``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["read_checkpoint"]


def read_checkpoint(store: Any, run_id: str) -> bytes:
    """The bytes of the run's checkpoint to load (:meth:`Store.find_checkpoint`: the
    owner's newest whole one, else the one before it); a FileNotFoundError naming the run
    and the store when it has none."""
    path = store.find_checkpoint(run_id)
    if path is None:
        raise FileNotFoundError(
            f"run {run_id!r} has no checkpoint in the store {store.prefix_path}: its workers "
            "wrote none, or it was removed. Fit again to train it."
        )
    return bytes(store.read_bytes(path))
