"""Sharded checkpoints of a ``strategy='fsdp'`` run, kept under the Store's fencing.

Each epoch every rank writes its shard of the model and optimizer state
(``torch.distributed.checkpoint``, through :meth:`Prepared.save_sharded`) into a folder
of its own, ``<store>/runs/<run_id>/sharded/<fit>-<attempt>-<epoch>/``: a name no other
writer or epoch uses, so nothing is ever overwritten. Only then does rank 0 write the
run's ``checkpoint.pt`` through :meth:`Store.write_checkpoint`, as under ring, holding
the epoch, the history, the scheduler and the folder's name (``"sharded"``) instead of
the weights: that file is the pointer to the latest checkpoint, written whole or not at
all and refused to a zombie writer (the Store's claims and fencing). DCP's save returns
on rank 0 only once every rank's shard and the folder's metadata are written, so a
half-written sharded checkpoint is never named by a pointer, and a pointer's folder is
always whole. After each pointer, rank 0 removes the folders no pointer it may fall back
to names (the pointer's and the previous one's are kept), of its own writer and older
ones only. The last epoch's pointer also holds the whole model (``"model"``, gathered
once), so the driver's ``load_checkpoint`` and a resume's model check read it as today.
A resume loads the folder on any number of ranks (DCP reshards).
"""

from __future__ import annotations

import logging
import posixpath
import re
from typing import Any

import fsspec

__all__ = ["SHARDED_KEY", "ShardFolders", "shard_url"]

log = logging.getLogger("ringtrain.estimators")

SHARDED_KEY = "sharded"  # the pointer's key naming its folder under sharded/
_FOLDER = re.compile(r"^(-?\d+)-(-?\d+)-(\d+)$")  # <fit>-<attempt>-<epoch>


def _root(store: Any, run_id: str) -> str:
    return posixpath.join(store.get_run_path(run_id), "sharded")


def shard_url(store: Any, run_id: str, name: str) -> str:
    """Where the folder ``name`` (a pointer's ``"sharded"``) of the run is."""
    return posixpath.join(_root(store, run_id), name)


def storage_options(store: Any) -> dict[str, Any] | None:
    """The fsspec options of the store's files (an object store's), else None."""
    options = getattr(store, "storage_options", None)
    return dict(options) if options else None


class ShardFolders:
    """One writer's sharded folders: their names, and the removal of those no pointer
    may fall back to any more (see the module docstring)."""

    def __init__(self, store: Any, run_id: str, writer: tuple[int, int]) -> None:
        self.store, self.run_id, self.writer = store, run_id, writer
        self.kept: list[str] = []  # the folders of the latest pointers, oldest first

    def name(self, epoch: int) -> str:
        return f"{self.writer[0]}-{self.writer[1]}-{epoch}"

    def resumed_from(self, name: str) -> None:
        self.kept = [name]

    def committed(self, name: str) -> None:
        """``name``'s pointer is written: keep it and the one before, remove the rest of
        this writer's and older writers' folders (a newer writer's are never touched)."""
        self.kept = [*self.kept, name][-2:]
        root = _root(self.store, self.run_id)
        try:
            fs, path = fsspec.core.url_to_fs(root, **(storage_options(self.store) or {}))
            fs.invalidate_cache(path)
            names = [posixpath.basename(n.rstrip("/")) for n in fs.ls(path, detail=False)]
        except OSError as exc:
            log.debug("could not list %s (%s); the next checkpoint tries again", root, exc)
            return
        for old in names:
            match = _FOLDER.match(old)
            if old in self.kept or not match or (int(match[1]), int(match[2])) > self.writer:
                continue
            try:
                fs.rm(posixpath.join(path, old), recursive=True)
            except OSError as exc:
                log.debug("could not remove %s (%s); a later checkpoint tries again", old, exc)
