"""Checkpoints: a directory on some filesystem, and the run folder that keeps the reported ones.

A reported checkpoint lives in ``<run dir>/checkpoint_<6-digit index>/`` on the run's
storage (a local folder or an object store, see ``_storage``). Every rank that reports
a checkpoint uploads its files into that one folder (sharded checkpoints, as Ray
Train): rank 0 straight into the folder, rank r into ``.ringtrain/shards/checkpoint_<index>/rank_<r>/``;
when every rank is done, the driver moves the other ranks' files into the folder (on a
name that two ranks wrote, the lower rank's file is kept: rank 0's, then rank 1's, ...)
and writes the commit record ``<run dir>/.ringtrain/checkpoint_<index>.json`` (the
metrics and each rank's files). Only a committed checkpoint counts: a folder that a
killed attempt left half-uploaded has no record, is never resumed from, and is removed
before the next attempt starts. Retention (``num_to_keep``, by score when
``checkpoint_score_attribute`` is set) removes the record first, then the folder; the
latest checkpoint is always kept, since a restart resumes from it.
"""

from __future__ import annotations

import contextlib
import json
import os
import posixpath
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ringcore.runs import fsync_tree, write_file

from . import _constants as const

__all__ = ["Checkpoint", "CheckpointStore", "Committed"]

_NAME = re.compile(rf"^{const.CHECKPOINT_DIR_PREFIX}(\d{{6}})$")
_RECORD = re.compile(rf"^{const.CHECKPOINT_DIR_PREFIX}(\d{{6}})\.json$")
RECORDS_DIR = ".ringtrain"


def _local_fs() -> Any:
    import pyarrow.fs as pafs

    return pafs.LocalFileSystem()


@dataclass(frozen=True)
class Checkpoint:
    """A directory of files that a training loop saved: ``path`` on ``filesystem``.

    ``filesystem`` is a ``pyarrow.fs.FileSystem`` (None: this machine's disk), as in Ray
    Train; a checkpoint in an object store pickles as its path and filesystem.
    """

    path: str
    filesystem: Any = field(default=None, compare=False)

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        full = os.path.abspath(os.fspath(path))
        if not os.path.isdir(full):
            raise ValueError(f"Checkpoint.from_directory needs an existing directory, got {full!r}")
        return cls(full)

    @property
    def _remote(self) -> bool:
        import pyarrow.fs as pafs

        return self.filesystem is not None and not isinstance(self.filesystem, pafs.LocalFileSystem)

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint's files to the local ``path`` (a new temporary directory when None)."""
        target = (
            os.fspath(path)
            if path is not None
            else tempfile.mkdtemp(prefix="ringtrain_checkpoint_")
        )
        if not self._remote:
            shutil.copytree(self.path, target, dirs_exist_ok=True)
            return target
        import pyarrow.fs as pafs

        os.makedirs(target, exist_ok=True)
        pafs.copy_files(
            self.path, target, source_filesystem=self.filesystem, destination_filesystem=_local_fs()
        )
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory holding the checkpoint's files, for reading only (a temporary
        download, removed afterwards, when the checkpoint is in remote storage)."""
        if not self._remote:
            yield self.path
            return
        tmp = self.to_directory()
        try:
            yield tmp
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class Committed:
    """A committed checkpoint: its index, rank 0's metrics, and each rank's files."""

    index: int
    checkpoint: Checkpoint
    metrics: dict
    files: dict[int, list[str]]


def local_files(path: str) -> list[str]:
    """The files under a local directory, as sorted paths relative to it (``/``-separated)."""
    out: list[str] = []
    for folder, _, files in os.walk(path):
        rel = os.path.relpath(folder, path)
        out.extend(f if rel == "." else posixpath.join(rel.replace(os.sep, "/"), f) for f in files)
    return sorted(out)


class CheckpointStore:
    """The checkpoints of one run under ``run_dir`` on ``filesystem`` (local when None)."""

    def __init__(
        self,
        run_dir: str,
        num_to_keep: int | None = None,
        filesystem: Any = None,
        score_attribute: str | None = None,
        score_order: str = "max",
    ):
        self.run_dir = run_dir
        self.num_to_keep = num_to_keep
        self.filesystem = filesystem if filesystem is not None else _local_fs()
        self.score_attribute = score_attribute
        self.score_order = score_order

    # ---------------------------------------------------------------- paths and listing
    def folder(self, index: int) -> str:
        return self._join(self.run_dir, f"{const.CHECKPOINT_DIR_PREFIX}{index:06d}")

    def _join(self, *parts: str) -> str:
        import pyarrow.fs as pafs

        if isinstance(self.filesystem, pafs.LocalFileSystem):
            return os.path.join(*parts)
        return posixpath.join(*parts)

    def _record(self, index: int) -> str:
        return self._join(
            self.run_dir, RECORDS_DIR, f"{const.CHECKPOINT_DIR_PREFIX}{index:06d}.json"
        )

    def _list(self, folder: str, pattern: re.Pattern) -> list[int]:
        import pyarrow.fs as pafs

        selector = pafs.FileSelector(folder, allow_not_found=True)
        found = []
        for info in self.filesystem.get_file_info(selector):
            match = pattern.match(info.base_name)
            if match:
                found.append(int(match.group(1)))
        return sorted(found)

    def committed(self) -> list[Committed]:
        """Every committed checkpoint, oldest first."""
        out = []
        for index in self._list(self._join(self.run_dir, RECORDS_DIR), _RECORD):
            try:
                with self.filesystem.open_input_stream(self._record(index)) as fh:
                    record = json.loads(fh.read().decode())
            except (OSError, ValueError):
                continue  # removed by retention while we listed
            files = {int(rank): names for rank, names in record["files"].items()}
            out.append(Committed(index, self.checkpoint(index), record["metrics"], files))
        return out

    def checkpoint(self, index: int) -> Checkpoint:
        import pyarrow.fs as pafs

        local = isinstance(self.filesystem, pafs.LocalFileSystem)
        return Checkpoint(self.folder(index), None if local else self.filesystem)

    def indexed(self) -> list[tuple[int, Checkpoint]]:
        """Every committed checkpoint with its index, oldest first."""
        return [(c.index, c.checkpoint) for c in self.committed()]

    def latest(self) -> Checkpoint | None:
        found = self.committed()
        return found[-1].checkpoint if found else None

    def next_index(self) -> int:
        """One past every checkpoint folder, committed or not."""
        seen = self._list(self.run_dir, _NAME) + [c.index for c in self.committed()]
        return max(seen) + 1 if seen else 0

    # ---------------------------------------------------------------- writing
    def staging(self, index: int, rank: int) -> str:
        return self._join(
            self.run_dir,
            RECORDS_DIR,
            "shards",
            f"{const.CHECKPOINT_DIR_PREFIX}{index:06d}",
            f"rank_{rank}",
        )

    def upload(self, checkpoint: Checkpoint, index: int, rank: int = 0) -> list[str]:
        """Copy rank ``rank``'s ``checkpoint`` for checkpoint ``index`` (rank 0: into its folder,
        others: into their staging folder); its relative files."""
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"report(checkpoint=...) takes a ray_runner.Checkpoint, got {type(checkpoint).__name__}; "
                "wrap a directory with Checkpoint.from_directory(path)"
            )
        import pyarrow.fs as pafs

        target = self.folder(index) if rank == 0 else self.staging(index, rank)
        files = local_files(checkpoint.path) if not checkpoint._remote else None
        self.filesystem.create_dir(target, recursive=True)
        if isinstance(self.filesystem, pafs.LocalFileSystem) and not checkpoint._remote:
            shutil.copytree(checkpoint.path, target, dirs_exist_ok=True)
            fsync_tree(target)
        else:
            pafs.copy_files(
                checkpoint.path,
                target,
                source_filesystem=checkpoint.filesystem or _local_fs(),
                destination_filesystem=self.filesystem,
            )
        if files is None:
            files = sorted(
                posixpath.relpath(i.path, target)
                for i in self.filesystem.get_file_info(pafs.FileSelector(target, recursive=True))
                if i.type == pafs.FileType.File
            )
        return files

    def merge(self, index: int, files: dict[int, list[str]]) -> dict[int, list[str]]:
        """Move the other ranks' staged files into checkpoint folder ``index``; a name already
        there (from a lower rank) keeps the lower rank's file. Each rank's files as kept."""
        kept: dict[int, list[str]] = {0: list(files.get(0, []))}
        owned = set(kept[0])
        for rank in sorted(r for r in files if r != 0):
            staged = self.staging(index, rank)
            kept[rank] = []
            for name in files[rank]:
                if name in owned:
                    continue
                target = self._join(self.folder(index), *name.split("/"))
                self.filesystem.create_dir(self._parent(target), recursive=True)
                self.filesystem.move(self._join(staged, *name.split("/")), target)
                owned.add(name)
                kept[rank].append(name)
        if len(files) > 1:  # this index's staging folder, with every rank's (now empty) one
            with contextlib.suppress(OSError):
                self.filesystem.delete_dir(self._parent(self.staging(index, 1)))
        return kept

    def _parent(self, path: str) -> str:
        import pyarrow.fs as pafs

        local = isinstance(self.filesystem, pafs.LocalFileSystem)
        return os.path.dirname(path) if local else posixpath.dirname(path)

    def commit(self, index: int, metrics: dict, files: dict[int, list[str]]) -> Committed:
        """Merge the ranks' files, record checkpoint ``index`` as whole, then apply retention."""
        files = self.merge(index, files)
        record = json.dumps({"index": index, "metrics": metrics, "files": files}, default=str)
        self.filesystem.create_dir(self._join(self.run_dir, RECORDS_DIR), recursive=True)
        final = self._record(index)
        import pyarrow.fs as pafs

        if isinstance(self.filesystem, pafs.LocalFileSystem):
            # a temporary fsynced, renamed, the folder fsynced: whole or absent after a crash
            write_file(final, lambda fh: fh.write(record.encode()))
        else:  # an object store's PUT is atomic
            with self.filesystem.open_output_stream(final) as out:
                out.write(record.encode())
        self._prune()
        return Committed(index, self.checkpoint(index), metrics, files)

    def persist(self, checkpoint: Checkpoint, metrics: dict | None = None) -> Checkpoint:
        """Upload and commit ``checkpoint`` as the next index (one writer: rank 0 alone)."""
        index = self.next_index()
        files = self.upload(checkpoint, index)
        return self.commit(index, dict(metrics or {}), {0: files}).checkpoint

    def remove_uncommitted(self) -> None:
        """Remove checkpoint folders without a commit record (a killed attempt's partial uploads);
        called by the driver between attempts, when no worker writes."""
        committed = {c.index for c in self.committed()}
        for index in self._list(self.run_dir, _NAME):
            if index not in committed:
                with contextlib.suppress(OSError):
                    self.filesystem.delete_dir(self.folder(index))
        with contextlib.suppress(OSError):
            self.filesystem.delete_dir(self._join(self.run_dir, RECORDS_DIR, "shards"))

    # ---------------------------------------------------------------- retention
    def score(self, metrics: dict) -> float:
        value = metrics.get(self.score_attribute) if self.score_attribute else None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(
                f"CheckpointConfig(checkpoint_score_attribute={self.score_attribute!r}) needs a "
                f"number under that key in the metrics reported with every checkpoint, got "
                f"{sorted(metrics)} ({self.score_attribute!r}={value!r}); report it, or change "
                "checkpoint_score_attribute"
            )
        return float(value)

    def ranked(self, found: list[Committed] | None = None) -> list[Committed]:
        """The committed checkpoints best first by score, or newest first without a score."""
        found = self.committed() if found is None else found
        if not self.score_attribute:
            return sorted(found, key=lambda c: -c.index)
        sign = -1.0 if self.score_order == "max" else 1.0
        return sorted(found, key=lambda c: (sign * self.score(c.metrics), -c.index))

    def _prune(self) -> None:
        if self.num_to_keep is None:
            return
        found = self.committed()
        if len(found) <= self.num_to_keep:
            return
        latest = found[-1].index
        keep = {c.index for c in self.ranked(found)[: self.num_to_keep]} | {latest}
        for item in found:
            if item.index in keep:
                continue
            with contextlib.suppress(OSError):
                self.filesystem.delete_file(self._record(item.index))
            with contextlib.suppress(OSError):
                self.filesystem.delete_dir(item.checkpoint.path)
