"""The Store: where an estimator keeps its intermediate Parquet data and its runs.

:meth:`Store.create` picks the implementation for a prefix: :class:`LocalStore` for a
path every worker mounts, :class:`VolumeStore` / :class:`DBFSLocalStore` for Databricks'
FUSE mounts, :class:`FsspecStore` for any other URL. Each is the run-services layer's
store of runs (:class:`ringcore.runs.LocalRunStore`, :class:`ringcore.runs.FsspecRunStore`:
whole-file writes, the run's checkpoints and who may write them) with the Spark side
added: the data folders, the URLs Spark writes Parquet by, the workers' readers. Paths
under the prefix are the layout's (``_layout``). A Store is plain, picklable data: it
crosses to the workers, which write checkpoints through it.
"""

from __future__ import annotations

import os
import posixpath
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from ringcore.runs import (
    ClaimUnreadableError,
    FsspecRunStore,
    LocalRunStore,
    RunStore,
    StaleWriterError,
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

# Spark (Hadoop) spells some fsspec schemes differently.
_SPARK_SCHEMES = {"s3": "s3a", "gcs": "gs"}
PARQUET_WRITERS = ("auto", "spark", "arrow")
_CLAIM_LOCK = threading.Lock()


class Store(StoreLayout, StoreFiles, RunStore):
    """Base of every store; make one with :meth:`Store.create`.

    Paths derive from ``prefix_path`` (``StoreLayout``); a run's files and checkpoints
    are the run-services layer's (:class:`ringcore.runs.RunStore`), the data's I/O is
    ``StoreFiles``'.
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


@dataclass(frozen=True)
class LocalStore(LocalRunStore, Store):
    """A store on a filesystem every worker mounts at the same path (local disk in local
    mode): a run's files are :class:`ringcore.runs.LocalRunStore`'s, Spark reads and
    writes its Parquet by ``file://`` URL, in place."""

    def url(self, path: str) -> str:
        return "file://" + path

    def parquet_dataset(self, path: str) -> Any:
        import pyarrow.dataset as pads

        return pads.dataset(path, format="parquet")

    def localize(self, path: str) -> str:
        return path


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


@dataclass(frozen=True)
class FsspecStore(FsspecRunStore, Store):
    """A store on any fsspec filesystem, by URL (``s3://bucket/prefix``, ``memory://x``):
    a run's files are :class:`ringcore.runs.FsspecRunStore`'s; this adds how its Parquet
    is written and read."""

    #: copy each worker's dataset to its local TMPDIR before reading (else: read in place)
    local_copy: bool = False
    #: who writes the prepared Parquet: "spark" (Hadoop), "arrow" (the executors' Python
    #: workers through fsspec) or "auto" (spark where Hadoop has the scheme and no
    #: storage_options are given, else arrow); see estimators.data._parquet_writer
    parquet_writer: str = "auto"

    def __post_init__(self) -> None:
        super().__post_init__()
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
    def spark_can_write(self) -> bool:
        return self.protocol != "memory"

    def url(self, path: str) -> str:
        scheme, rest = path.split("://", 1)
        return f"{_SPARK_SCHEMES.get(scheme, scheme)}://{rest}"

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
