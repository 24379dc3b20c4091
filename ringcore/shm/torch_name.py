"""The ``torch.distributed`` backend's name, and its registration, without importing
torch: ``ringcore.dist_backend`` registers its creator through :func:`register_with`,
and the launchers' guard (``ringcore.launch._ring_backend``) a lazy one that imports
``ringcore.dist_backend`` only when a group of the backend first forms."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["BACKEND_NAME", "register_with"]

BACKEND_NAME = "ring"


def register_with(dist: Any, create: Callable[..., Any]) -> bool:
    """Make ``"ring"`` a backend of ``dist`` (``torch.distributed``) whose groups
    ``create`` makes, unless some creator is registered already (the first wins: both
    end in ``ringcore.dist_backend.create_process_group``). True: registered now."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return False
    dist.Backend.register_backend(BACKEND_NAME, create, extended_api=True, devices=["cpu"])
    return True
