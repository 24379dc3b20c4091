"""Checkpoints: a directory, and the run folder that keeps the reported ones.

A reported checkpoint is copied to ``<run dir>/checkpoint_<6-digit index>/``: first to
a hidden temporary name in the same folder, then renamed, so a reader never sees a
half-copied checkpoint. The run folder itself is the record: the latest checkpoint is
the one with the highest index, which is what a restarted group resumes from.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

from . import _constants as const

__all__ = ["Checkpoint", "CheckpointStore"]

_NAME = re.compile(rf"^{const.CHECKPOINT_DIR_PREFIX}(\d{{6}})$")


@dataclass(frozen=True)
class Checkpoint:
    """A directory of files that a training loop saved. Pickles as its path."""

    path: str

    @classmethod
    def from_directory(cls, path: str | os.PathLike) -> Checkpoint:
        full = os.path.abspath(os.fspath(path))
        if not os.path.isdir(full):
            raise ValueError(f"Checkpoint.from_directory needs an existing directory, got {full!r}")
        return cls(full)

    def to_directory(self, path: str | os.PathLike | None = None) -> str:
        """Copy the checkpoint's files to ``path`` (a new temporary directory when None)."""
        target = (
            os.fspath(path)
            if path is not None
            else tempfile.mkdtemp(prefix="ringtrain_checkpoint_")
        )
        shutil.copytree(self.path, target, dirs_exist_ok=True)
        return target

    @contextlib.contextmanager
    def as_directory(self) -> Iterator[str]:
        """A local directory holding the checkpoint's files, for reading only."""
        yield self.path


class CheckpointStore:
    """The checkpoints of one run under ``run_dir``, keeping the latest ``num_to_keep``."""

    def __init__(self, run_dir: str, num_to_keep: int | None = None):
        self.run_dir = run_dir
        self.num_to_keep = num_to_keep

    def indexed(self) -> list[tuple[int, Checkpoint]]:
        """Every persisted checkpoint with its index, oldest first."""
        if not os.path.isdir(self.run_dir):
            return []
        found = []
        for entry in os.listdir(self.run_dir):
            match = _NAME.match(entry)
            if match and os.path.isdir(os.path.join(self.run_dir, entry)):
                found.append((int(match.group(1)), Checkpoint(os.path.join(self.run_dir, entry))))
        return sorted(found, key=lambda item: item[0])

    def latest(self) -> Checkpoint | None:
        found = self.indexed()
        return found[-1][1] if found else None

    def persist(self, checkpoint: Checkpoint) -> Checkpoint:
        """Copy ``checkpoint`` in as the next index, then drop the oldest beyond ``num_to_keep``.

        The copy's files and folders are fsynced before the rename and the run folder
        after it, so a host crash leaves the new checkpoint whole or absent (never empty
        files under its final name) before ``_prune`` drops an older one; copies that a
        killed process left (``.tmp_checkpoint_*``) are removed."""
        if not isinstance(checkpoint, Checkpoint):
            raise TypeError(
                f"report(checkpoint=...) takes a ray_runner.Checkpoint, got {type(checkpoint).__name__}; "
                "wrap a directory with Checkpoint.from_directory(path)"
            )

        def fsync(path: str, directory: bool) -> None:
            fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
            try:
                os.fsync(fd)
            except OSError as exc:  # a folder some filesystems cannot fsync; EIO still raises
                if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
                    raise
            finally:
                os.close(fd)

        os.makedirs(self.run_dir, exist_ok=True)
        found = self.indexed()
        index = found[-1][0] + 1 if found else 0
        name = f"{const.CHECKPOINT_DIR_PREFIX}{index:06d}"
        final = os.path.join(self.run_dir, name)
        tmp_prefix = f".tmp_{const.CHECKPOINT_DIR_PREFIX}"
        tmp = os.path.join(self.run_dir, f".tmp_{name}_{uuid.uuid4().hex[:8]}")
        try:
            shutil.copytree(checkpoint.path, tmp)
            for folder, _, files in os.walk(tmp, topdown=False):
                for file in files:
                    fsync(os.path.join(folder, file), directory=False)
                fsync(folder, directory=True)
            os.rename(tmp, final)
            fsync(self.run_dir, directory=True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        for entry in os.listdir(self.run_dir):  # a copy a killed process left behind
            if entry.startswith(tmp_prefix):
                shutil.rmtree(os.path.join(self.run_dir, entry), ignore_errors=True)
        self._prune()
        return Checkpoint(final)

    def _prune(self) -> None:
        if self.num_to_keep is None:
            return
        found = self.indexed()
        for _, old in found[: max(0, len(found) - self.num_to_keep)]:
            shutil.rmtree(old.path, ignore_errors=True)
