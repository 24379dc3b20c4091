"""A run's store: whole files under a prefix, and the run's checkpoints kept through it.

:class:`RunStore` is what every store does for a run's files (read, write whole,
create exclusively, remove) and the checkpoint API built on that (claim the run, write
a fenced checkpoint, find the newest whole one); paths come from
:class:`~ringcore.runs.layout.RunLayout`. Two filesystems implement it:

- :class:`LocalRunStore`: a POSIX folder every worker mounts at the same path. Whole-file
  writes are a locked temporary, fsynced and renamed (:mod:`ringcore.runs.files`); the
  run's checkpoints are renamed in place under the run's lock
  (:class:`~ringcore.runs.checkpoints.InPlaceCheckpoints`).
- :class:`FsspecRunStore`: any fsspec filesystem, by URL (``s3://bucket/prefix``,
  ``memory://x``). A write is a temporary of the writer's own moved into place; each
  writer keeps its checkpoints in a folder of its own
  (:class:`~ringcore.runs.checkpoints.PerWriterCheckpoints`).

Both are frozen dataclasses: plain, picklable data that crosses to the workers, which
write checkpoints through it. The estimators' ``LocalStore`` and ``FsspecStore`` are
these with the Spark side added (the URLs Spark writes Parquet by, the data folders).
fsspec is imported only by an :class:`FsspecRunStore` that touches its filesystem.
"""

from __future__ import annotations

import abc
import json
import os
import posixpath
import re
import shutil
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

from .checkpoints import (
    CHECKPOINT_FILE,
    InPlaceCheckpoints,
    PerWriterCheckpoints,
    checkpoint_problem,
    worth_keeping,
)
from .files import PREVIOUS_SUFFIX, temp_name, write_file
from .layout import RunLayout

__all__ = ["FsspecRunStore", "LocalRunStore", "RunStore"]

_GLOB_MAGIC = re.compile(r"[*?[]")


def _keeps_previous(path: str) -> bool:
    return posixpath.basename(path) == CHECKPOINT_FILE


class RunStore(RunLayout, abc.ABC):
    """The files of a store's runs and their checkpoints (see the module docstring)."""

    prefix_path: str

    # --- the I/O each filesystem implements -------------------------------------------

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def open_read(self, path: str) -> BinaryIO: ...

    @abc.abstractmethod
    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """Call ``write(file)`` on a temporary file of this writer's own, then move it to
        ``path``, so a reader sees the old file or the new one, never half of one. On a
        local filesystem the file is fsynced before the move and its folder after, so a
        host crash cannot leave an empty ``path`` behind. A checkpoint
        (``checkpoint.pt``) keeps the one it replaces, when whole, as
        ``checkpoint.pt.prev``, which :meth:`find_checkpoint` falls back to. Unfenced:
        :meth:`write_checkpoint` is the run checkpoint's write."""

    @abc.abstractmethod
    def _create_exclusive(self, path: str) -> bool:
        """Create an empty file at ``path`` unless something is there: True if this call
        created it, False if it existed (the filesystem's exclusive create)."""

    @abc.abstractmethod
    def rm(self, path: str) -> None:
        """Remove the file or directory tree at ``path``; nothing there is fine."""

    def is_local(self) -> bool:
        """Whether the store's paths are this machine's files (no copy to read them)."""
        return False

    def write_bytes(self, path: str, data: bytes) -> None:
        self.write_atomic(path, lambda f: f.write(data))

    def read_bytes(self, path: str) -> bytes:
        with self.open_read(path) as f:
            return f.read()

    def write_json(self, path: str, value: Any) -> None:
        self.write_bytes(path, json.dumps(value, indent=1).encode())

    def read_json(self, path: str) -> Any:
        return json.loads(self.read_bytes(path))

    # --- who may write a run's checkpoints (ringcore.runs.checkpoints) ----------------

    @property
    @abc.abstractmethod
    def _checkpoints(self) -> InPlaceCheckpoints | PerWriterCheckpoints:
        """How this store keeps run checkpoints: in place under a lock, or per writer."""

    def claim_run(self, run_id: str, writer: tuple[int, int]) -> None:
        """The run's checkpoints are ``writer``'s from now on (rank 0, as an attempt
        starts); a StaleWriterError when a newer writer claimed them already, a
        ClaimUnreadableError when the claim cannot be read (the store failing)."""
        self._checkpoints.claim(run_id, (int(writer[0]), int(writer[1])))

    def write_checkpoint(
        self, run_id: str, writer: tuple[int, int], write: Callable[[BinaryIO], object]
    ) -> None:
        """Write the run's checkpoint with ``write(file)``, whole or not at all, keeping
        the one before it; a StaleWriterError (nothing written) when a newer writer than
        ``writer`` has claimed the run, checked at the commit point."""
        self._checkpoints.write(run_id, (int(writer[0]), int(writer[1])), write)

    def find_checkpoint(self, run_id: str) -> str | None:
        """The run's checkpoint file to resume from, if any: the owner's newest.

        A checkpoint that is empty, truncated or fails its CRCs (what a host crash can
        leave) is passed over, with a warning naming it, for the previous one kept beside
        it (``checkpoint.pt.prev``). When no whole one is left, the newest damaged one is
        returned, so the caller's error names it. Runs of the layout before
        ``checkpoint/`` (``runs/<run_id>/checkpoint.pt``) are found too."""
        return self._checkpoints.find(run_id)

    def checkpoint_problem(self, path: str) -> str | None:
        """Why the checkpoint file at ``path`` is not whole, or None (see
        :func:`ringcore.runs.checkpoints.checkpoint_problem`)."""
        try:
            with self.open_read(path) as f:
                return checkpoint_problem(f)
        except OSError as exc:
            return f"unreadable: {type(exc).__name__}: {exc}"


@dataclass(frozen=True)
class LocalRunStore(RunStore):
    """Runs on a filesystem every worker mounts at the same path (local disk in local
    mode); ``prefix_path`` is made absolute."""

    prefix_path: str

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "prefix_path", os.path.abspath(os.path.expanduser(self.prefix_path))
        )

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    @property
    def _checkpoints(self) -> InPlaceCheckpoints:
        return InPlaceCheckpoints(self)

    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """As :meth:`RunStore.write_atomic`, through :func:`ringcore.runs.files.write_file`:
        the temporary is locked by its writer, and a writer SIGKILLed mid-write (a lost
        worker, an earlier attempt) left one that the next good write of the same path
        removes; a live writer's is never removed."""
        keep = (lambda p: worth_keeping(self, p)) if _keeps_previous(path) else None
        write_file(path, write, keep_previous=keep)

    def _create_exclusive(self, path: str) -> bool:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        return True

    def rm(self, path: str) -> None:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)

    def is_local(self) -> bool:
        return True


def _move(fs: Any, src: str, dst: str) -> None:
    """``fs.mv``, except that a name holding glob characters (``[``, ``*``, ``?``), which
    ``mv`` would expand, is copied and removed as the one file it names."""
    if _GLOB_MAGIC.search(src) or _GLOB_MAGIC.search(dst):
        fs.cp_file(src, dst)
        fs.rm_file(src)
    else:
        fs.mv(src, dst)


@dataclass(frozen=True)
class FsspecRunStore(RunStore):
    """Runs on any fsspec filesystem, by URL (``s3://bucket/prefix``, ``memory://x``),
    opened with ``storage_options``."""

    prefix_path: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_path", self.prefix_path.rstrip("/"))

    @property
    def protocol(self) -> str:
        return self.prefix_path.split("://", 1)[0]

    @property
    def fs(self) -> Any:
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options)  # fsspec caches these

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def open_read(self, path: str) -> BinaryIO:
        return self.fs.open(path, "rb")

    @property
    def _checkpoints(self) -> PerWriterCheckpoints:
        return PerWriterCheckpoints(self)

    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """As :meth:`RunStore.write_atomic`. Only this writer's temporary is ever removed
        here: on an object store a live writer's cannot be told from a dead one's. (A
        run checkpoint's temporary lies in its writer's folder, which goes once a newer
        writer's checkpoint is in place: :mod:`ringcore.runs.checkpoints`.)"""
        fs, tmp = self.fs, temp_name(path)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        try:
            with fs.open(tmp, "wb") as f:
                write(f)
            if _keeps_previous(path) and worth_keeping(self, path):
                _move(fs, path, path + PREVIOUS_SUFFIX)
            _move(fs, tmp, path)
        finally:
            if fs.exists(tmp):
                fs.rm_file(tmp)  # rm_file: takes the name as it is, no glob

    def _create_exclusive(self, path: str) -> bool:
        """Mode ``xb`` (a conditional put on object stores that support one), then a read
        back of a token of ours, in case a filesystem checks-then-creates under ``xb``."""
        fs, token = self.fs, uuid.uuid4().hex.encode()
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        try:
            with fs.open(path, "xb") as f:
                f.write(token)
        except FileExistsError:
            return False
        except (ValueError, NotImplementedError):  # no "xb" here: check, put, read back
            if fs.exists(path):
                return False
            fs.pipe_file(path, token)
        return bool(fs.cat_file(path) == token)

    def rm(self, path: str) -> None:
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)
