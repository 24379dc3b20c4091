"""The ``torch.distributed`` backend ``"ring"`` in every process a launcher starts.

A program written for torchrun names it (``init_process_group("cpu:ring")``) without
importing ringcore: the launchers install the guard on ``init_process_group``
(:func:`ringcore.launch.install_init_guard`), and with it this registration, right after
the program imports ``torch.distributed``. What is registered is a creator that imports
``ringcore.dist_backend`` (the segment, the groups) only when a group of it first forms,
so a program that never names it pays nothing."""

from __future__ import annotations

from typing import Any

from ..shm.torch_name import register_with


def _create(opts: Any, pg_options: Any = None) -> Any:
    from ..dist_backend import create_process_group

    return create_process_group(opts, pg_options)


def know_ring(dist: Any) -> None:
    """Register the backend ``"ring"`` with ``dist`` unless it is known already."""
    register_with(dist, _create)
