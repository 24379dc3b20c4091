"""A fit's TensorBoard scalars read back from its store.

Rank 0 writes them during the fit under ``<store>/runs/<run_id>/logs`` through the
run-services layer's :class:`ringcore.runs.ScalarWriter` (``step/loss`` and
``epoch/<name>``; a remote store gets the event files copied in at every epoch's end);
:func:`read_tensorboard_scalars` reads them back with :func:`ringcore.runs.read_scalars`,
copying them out of a remote store first.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

from ringcore.runs import read_scalars

__all__ = ["read_tensorboard_scalars"]


def read_tensorboard_scalars(store: Any, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` of a run's logs folder in ``store`` (local or
    remote; see :func:`ringcore.runs.read_scalars`)."""
    folder = store.get_logs_path(run_id)
    if store.is_local():
        return read_scalars(folder)
    local = store.localize(folder)
    try:
        return read_scalars(local)
    finally:
        shutil.rmtree(os.path.dirname(local), ignore_errors=True)
