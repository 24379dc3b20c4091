"""The Store: where an estimator keeps its intermediate Parquet data and its runs.

:meth:`Store.create` picks the implementation for a prefix: :class:`LocalStore` for a
path every worker mounts, :class:`VolumeStore` / :class:`DBFSLocalStore` for Databricks'
FUSE mounts, :class:`FsspecStore` for any other URL. Paths under the prefix are the layout's
(``_layout``); which checkpoint is the run's is ``_checkpoints``'. A Store is plain,
picklable data: it crosses to the workers, which write checkpoints through it.
"""

from __future__ import annotations

import abc
import logging
import os
import posixpath
import re
import shutil
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, ClassVar

from ._atomic import PREVIOUS_SUFFIX, write_file
from ._checkpoints import (
    CHECKPOINT_FILE,
    ClaimUnreadableError,
    InPlaceCheckpoints,
    PerWriterCheckpoints,
    StaleWriterError,
    checkpoint_problem,
    worth_keeping,
)
from ._databricks import (
    DATABRICKS_ENV_VAR,
    DBFS_ROOT_ENV_VAR,
    DEFAULT_DBFS_ROOT,
    DEFAULT_VOLUMES_ROOT,
    VOLUMES_ROOT_ENV_VAR,
    is_volume_path,
    volume_parts,
)
from ._files import StoreFiles
from ._layout import StoreLayout
from ._local_copy import LocalDiskFullError, copy_to_local

__all__ = [
    "ClaimUnreadableError",
    "DBFSLocalStore",
    "FsspecStore",
    "LocalDiskFullError",
    "LocalStore",
    "StaleWriterError",
    "Store",
    "VolumeStore",
]

log = logging.getLogger("ringtrain.estimators")

# Spark (Hadoop) spells some fsspec schemes differently.
_SPARK_SCHEMES = {"s3": "s3a", "gcs": "gs"}
PARQUET_WRITERS = ("auto", "spark", "arrow")
_CLAIM_LOCK = threading.Lock()
_GLOB_MAGIC = re.compile(r"[*?[]")


def _keeps_previous(path: str) -> bool:
    return posixpath.basename(path) == CHECKPOINT_FILE


class Store(StoreLayout, StoreFiles):
    """Base of every store; make one with :meth:`Store.create`.

    Paths derive from ``prefix_path`` (``StoreLayout``); subclasses do the I/O
    (``StoreFiles``).
    """

    prefix_path: str

    @staticmethod
    def create(
        prefix_path: str,
        storage_options: dict[str, Any] | None = None,
        *,
        local_copy: bool = False,
        parquet_writer: str = "auto",
    ) -> Store:
        """A store for ``prefix_path``. ``local_copy`` and ``parquet_writer`` are
        :class:`FsspecStore`'s (URLs only).

        - a local path or ``file://`` URL → :class:`LocalStore`;
        - ``/Volumes/<catalog>/<schema>/<volume>/x`` (or ``dbfs:/Volumes/...``) on
          Databricks → :class:`VolumeStore`, a Unity Catalog volume through its FUSE
          mount (root overridable with ``RING_VOLUMES_ROOT``, which is how tests emulate
          it); the path must name a volume: catalog, schema and volume;
        - ``dbfs:/x`` or ``/dbfs/x`` on Databricks (``DATABRICKS_RUNTIME_VERSION`` set) →
          :class:`DBFSLocalStore` on the FUSE mount ``/dbfs/x`` (root overridable with
          ``RING_DBFS_ROOT``; the DBFS root is deprecated under Unity Catalog);
        - any other URL (``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ``memory://``,
          ...) → :class:`FsspecStore`, ``storage_options`` passed to ``fsspec.filesystem``.
          Spark writes its Parquet through the URL (``s3://`` as ``s3a://``) when its
          Hadoop has the scheme and no ``storage_options`` are given, else the executors'
          Python workers do through fsspec (``parquet_writer``: ``"auto"``, ``"spark"``
          or ``"arrow"``). Workers read their row groups in place, streamed;
          ``local_copy=True`` copies each worker's dataset to its local disk first.
          ``memory://`` lives inside one process: the Store API on the driver (and
          tests), never a ``fit``, whose workers are other processes.
        """
        if not isinstance(prefix_path, str) or not prefix_path:
            raise ValueError(f"Store.create takes a non-empty path or URL, got {prefix_path!r}")
        remote = "://" in prefix_path and not prefix_path.startswith(("file://", "dbfs:"))
        if (local_copy or parquet_writer != "auto") and not remote:
            raise ValueError(
                f"Store.create({prefix_path!r}, local_copy={local_copy!r}, parquet_writer="
                f"{parquet_writer!r}): these options are for a remote fsspec URL (s3://, gs://, "
                "...); a path every worker mounts is read in place and written by Spark. "
                "Drop them, or give a URL."
            )
        if remote:
            return FsspecStore(
                prefix_path,
                dict(storage_options or {}),
                local_copy=local_copy,
                parquet_writer=parquet_writer,
            )
        on_databricks = bool(os.environ.get(DATABRICKS_ENV_VAR))
        if prefix_path.startswith("dbfs:"):
            if not on_databricks:
                raise ValueError(
                    f"Store.create({prefix_path!r}): dbfs: paths need Databricks "
                    f"({DATABRICKS_ENV_VAR} is not set). Use a local path or an fsspec URL."
                )
            if is_volume_path(prefix_path[len("dbfs:") :]):
                return VolumeStore("/" + prefix_path[len("dbfs:") :].lstrip("/"))
            return DBFSLocalStore(prefix_path)
        if on_databricks and is_volume_path(prefix_path):
            return VolumeStore(prefix_path)
        if on_databricks and (prefix_path == "/dbfs" or prefix_path.startswith("/dbfs/")):
            return DBFSLocalStore(prefix_path)
        if prefix_path.startswith("file://"):
            return LocalStore(prefix_path[len("file://") :])
        return LocalStore(prefix_path)

    # --- who may write a run's checkpoints (estimators.store._checkpoints) -----------------
    #
    # A writer is (fit, attempt): the driver's time_ns() when the fit started and the
    # Spark stage attempt. Rank 0 of each attempt claims the run when it starts; from
    # then on no older writer's checkpoint (a zombie attempt's) is ever the one read.

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
        :func:`estimators.store._checkpoints.checkpoint_problem`)."""
        try:
            with self.open_read(path) as f:
                return checkpoint_problem(f)
        except OSError as exc:
            return f"unreadable: {type(exc).__name__}: {exc}"

    def next_data_index(self) -> int:
        """Claim the first ``i`` with neither ``intermediate_train_data.<i>`` nor ``..val..``
        present, by creating its claim marker exclusively: two fits on one store (threads
        of one driver, or two drivers) never get the same index, so neither writes into,
        or cleans up, the other's data. Give it back with :meth:`release_data_index`."""
        with _CLAIM_LOCK:  # one driver's fits (CrossValidator parallelism) take turns
            idx = 0
            while True:
                taken = self.exists(self.get_train_data_path(idx)) or self.exists(
                    self.get_val_data_path(idx)
                )
                if not taken and self._create_exclusive(self.get_data_claim_path(idx)):
                    return idx
                idx += 1

    def release_data_index(self, idx: int) -> None:
        """Remove what the fit that claimed ``idx`` wrote there (its training and validation
        Parquet, then the claim): only that fit's own data, never another index."""
        for path in (self.get_train_data_path(idx), self.get_val_data_path(idx)):
            self.rm(path)
        self.rm(self.get_data_claim_path(idx))


def _tmp_name(path: str) -> str:
    """A temporary name beside ``path`` that is this writer's own."""
    return f"{path}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"


@dataclass(frozen=True)
class LocalStore(Store):
    """A store on a filesystem every worker mounts at the same path (local disk in local mode)."""

    prefix_path: str

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "prefix_path", os.path.abspath(os.path.expanduser(self.prefix_path))
        )

    def url(self, path: str) -> str:
        return "file://" + path

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def open_read(self, path: str) -> BinaryIO:
        return open(path, "rb")

    @property
    def _checkpoints(self) -> InPlaceCheckpoints:
        return InPlaceCheckpoints(self)

    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """As :meth:`Store.write_atomic`, through ``estimators.store._atomic.write_file``: the
        temporary is locked by its writer, and a writer SIGKILLed mid-write (a lost
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

    def parquet_dataset(self, path: str) -> Any:
        import pyarrow.dataset as pads

        return pads.dataset(path, format="parquet")

    def localize(self, path: str) -> str:
        return path

    def is_local(self) -> bool:
        return True


@dataclass(frozen=True)
class _DatabricksMountStore(LocalStore):
    """A LocalStore on one of Databricks' FUSE mounts, the same path on the driver and
    every executor. Spark names its files by ``dbfs:/`` URL (``dbfs:/`` standing for
    the local path ``DBFS_OF``); with the mount moved by the ``ROOT_ENV`` variable (tests,
    or a mount elsewhere) it names them ``file://``."""

    ROOT_ENV: ClassVar[str]
    DEFAULT_ROOT: ClassVar[str]
    DBFS_OF: ClassVar[str]

    @classmethod
    def root(cls) -> str:
        return os.environ.get(cls.ROOT_ENV) or cls.DEFAULT_ROOT

    def url(self, path: str) -> str:
        if self.root() == self.DEFAULT_ROOT:
            return "dbfs:/" + posixpath.relpath(path, self.DBFS_OF)
        return "file://" + path


@dataclass(frozen=True)
class DBFSLocalStore(_DatabricksMountStore):
    """Databricks File System through its local FUSE mount (``/dbfs``); Spark writes by
    ``dbfs:/`` URL. With ``RING_DBFS_ROOT`` set elsewhere, Spark writes ``file://``."""

    ROOT_ENV: ClassVar[str] = DBFS_ROOT_ENV_VAR
    DEFAULT_ROOT: ClassVar[str] = DEFAULT_DBFS_ROOT
    DBFS_OF: ClassVar[str] = DEFAULT_DBFS_ROOT  # dbfs:/x is /dbfs/x

    def __post_init__(self) -> None:
        """``dbfs:/x`` or ``/dbfs/x`` → ``<root>/x`` (root: ``RING_DBFS_ROOT`` or ``/dbfs``)."""
        prefix = self.prefix_path
        if prefix.startswith("dbfs:"):
            rest = prefix[len("dbfs:") :].lstrip("/")
        else:
            rest = prefix[len(DEFAULT_DBFS_ROOT) :].lstrip("/")
        object.__setattr__(self, "prefix_path", posixpath.join(self.root(), rest))


@dataclass(frozen=True)
class VolumeStore(_DatabricksMountStore):
    """A Unity Catalog volume on Databricks through its FUSE mount (``/Volumes/<catalog>/
    <schema>/<volume>/...``, the same path on the driver and every executor); Spark writes
    it as ``dbfs:/Volumes/...``. With ``RING_VOLUMES_ROOT`` set (tests, or a mount
    elsewhere) the path maps under that root and Spark writes ``file://``."""

    ROOT_ENV: ClassVar[str] = VOLUMES_ROOT_ENV_VAR
    DEFAULT_ROOT: ClassVar[str] = DEFAULT_VOLUMES_ROOT
    DBFS_OF: ClassVar[str] = "/"  # dbfs:/Volumes/x is /Volumes/x

    def __post_init__(self) -> None:
        parts = volume_parts(self.prefix_path)
        object.__setattr__(self, "prefix_path", posixpath.join(self.root(), *parts))

    @property
    def volume(self) -> str:
        """``<catalog>.<schema>.<volume>``: the volume this store lives in."""
        rel = posixpath.relpath(self.prefix_path, self.root()).split("/")
        return ".".join(rel[:3])


def _move(fs: Any, src: str, dst: str) -> None:
    """``fs.mv``, except that a name holding glob characters (``[``, ``*``, ``?``), which
    ``mv`` would expand, is copied and removed as the one file it names."""
    if _GLOB_MAGIC.search(src) or _GLOB_MAGIC.search(dst):
        fs.cp_file(src, dst)
        fs.rm_file(src)
    else:
        fs.mv(src, dst)


@dataclass(frozen=True)
class FsspecStore(Store):
    """A store on any fsspec filesystem, by URL (``s3://bucket/prefix``, ``memory://x``)."""

    prefix_path: str
    storage_options: dict[str, Any] = field(default_factory=dict)
    #: copy each worker's dataset to its local TMPDIR before reading (else: read in place)
    local_copy: bool = False
    #: who writes the prepared Parquet: "spark" (Hadoop), "arrow" (the executors' Python
    #: workers through fsspec) or "auto" (spark where Hadoop has the scheme and no
    #: storage_options are given, else arrow); see estimators.data._parquet_writer
    parquet_writer: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_path", self.prefix_path.rstrip("/"))
        if self.parquet_writer not in PARQUET_WRITERS:
            raise ValueError(
                f"FsspecStore({self.prefix_path!r}): parquet_writer={self.parquet_writer!r} is "
                f"not one of {', '.join(map(repr, PARQUET_WRITERS))}. Use 'auto' unless you "
                "know Spark's Hadoop can ('spark') or cannot ('arrow') write this scheme."
            )
        if not isinstance(self.local_copy, bool):
            raise ValueError(
                f"FsspecStore({self.prefix_path!r}): local_copy must be True or False, got "
                f"{self.local_copy!r}."
            )

    def read_options(self) -> dict[str, Any] | None:
        return dict(self.storage_options)

    def reads_in_place(self) -> bool:
        return not self.local_copy

    @property
    def protocol(self) -> str:
        return self.prefix_path.split("://", 1)[0]

    @property
    def fs(self) -> Any:
        import fsspec

        return fsspec.filesystem(self.protocol, **self.storage_options)  # fsspec caches these

    @property
    def spark_can_write(self) -> bool:
        return self.protocol != "memory"

    def url(self, path: str) -> str:
        scheme, rest = path.split("://", 1)
        return f"{_SPARK_SCHEMES.get(scheme, scheme)}://{rest}"

    def exists(self, path: str) -> bool:
        return bool(self.fs.exists(path))

    def open_read(self, path: str) -> BinaryIO:
        return self.fs.open(path, "rb")

    @property
    def _checkpoints(self) -> PerWriterCheckpoints:
        return PerWriterCheckpoints(self)

    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """As :meth:`Store.write_atomic`. Only this writer's temporary is ever removed
        here: on an object store a live writer's cannot be told from a dead one's. (A
        run checkpoint's temporary lies in its writer's folder, which goes once a newer
        writer's checkpoint is in place: ``estimators.store._checkpoints``.)"""
        fs, tmp = self.fs, _tmp_name(path)
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

    def parquet_dataset(self, path: str) -> Any:
        import pyarrow.dataset as pads
        from pyarrow.fs import FSSpecHandler, PyFileSystem

        fs = self.fs
        return pads.dataset(
            fs._strip_protocol(path), format="parquet", filesystem=PyFileSystem(FSSpecHandler(fs))
        )

    def localize(self, path: str) -> str:
        """A copy of ``path`` on this machine's disk, in a new temporary directory (the
        caller removes it); a full local disk raises :class:`LocalDiskFullError`."""
        return copy_to_local(self.fs, path)
