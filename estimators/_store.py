"""The Store: where an estimator keeps its intermediate Parquet data and its runs.

Layout under the prefix (as Horovod's)::

    <prefix>/intermediate_train_data.<i>/          Parquet, one file (one row group) per process
    <prefix>/intermediate_val_data.<i>/
    <prefix>/runs/<run_id>/checkpoint/checkpoint.pt  model + optimizer state, epoch, history
    <prefix>/runs/<run_id>/logs/history.json         the per-epoch metrics so far

(Runs written before this layout kept ``runs/<run_id>/checkpoint.pt``; a fit of such a
run resumes from it.)

``Store.create(prefix, storage_options=None)`` picks the implementation:

- a local path or ``file://`` URL → :class:`LocalStore`;
- ``dbfs:/x`` or ``/dbfs/x`` on Databricks (``DATABRICKS_RUNTIME_VERSION`` set) →
  :class:`DBFSLocalStore` on the FUSE mount ``/dbfs/x`` (root overridable with
  ``RING_DBFS_ROOT``);
- any other URL (``s3://``, ``gs://``, ``hdfs://``, ``abfs://``, ``memory://``, ...) →
  :class:`FsspecStore`, with ``storage_options`` passed to ``fsspec.filesystem``.
  Spark writes the Parquet through the URL (``s3://`` as ``s3a://``); workers copy
  their dataset to a local temporary directory through fsspec before reading it.
  ``memory://`` lives inside one process: it serves the Store API on the driver (and
  tests), never a ``fit``, whose workers are other processes.

A Store is plain, picklable data: it crosses to the workers, which write checkpoints
through it.
"""

from __future__ import annotations

import abc
import contextlib
import glob
import json
import os
import posixpath
import shutil
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO

__all__ = ["DBFSLocalStore", "FsspecStore", "LocalStore", "Store"]

TRAIN_DATA = "intermediate_train_data"
VAL_DATA = "intermediate_val_data"
CHECKPOINT_FILE = "checkpoint.pt"
HISTORY_FILE = "history.json"
DBFS_ROOT_ENV_VAR = "RING_DBFS_ROOT"
DEFAULT_DBFS_ROOT = "/dbfs"
DATABRICKS_ENV_VAR = "DATABRICKS_RUNTIME_VERSION"
# Spark (Hadoop) spells some fsspec schemes differently.
_SPARK_SCHEMES = {"s3": "s3a", "gcs": "gs"}


class Store(abc.ABC):
    """Base of every store; make one with :meth:`Store.create`.

    Paths derive from ``prefix_path`` here; subclasses do the I/O.
    """

    prefix_path: str

    @staticmethod
    def create(prefix_path: str, storage_options: dict[str, Any] | None = None) -> Store:
        """A store for ``prefix_path``: see the module docstring for the choices."""
        if not isinstance(prefix_path, str) or not prefix_path:
            raise ValueError(f"Store.create takes a non-empty path or URL, got {prefix_path!r}")
        on_databricks = bool(os.environ.get(DATABRICKS_ENV_VAR))
        if prefix_path.startswith("dbfs:"):
            if not on_databricks:
                raise ValueError(
                    f"Store.create({prefix_path!r}): dbfs: paths need Databricks "
                    f"({DATABRICKS_ENV_VAR} is not set). Use a local path or an fsspec URL."
                )
            return DBFSLocalStore(prefix_path)
        if on_databricks and (prefix_path == "/dbfs" or prefix_path.startswith("/dbfs/")):
            return DBFSLocalStore(prefix_path)
        if prefix_path.startswith("file://"):
            return LocalStore(prefix_path[len("file://") :])
        if "://" in prefix_path:
            return FsspecStore(prefix_path, dict(storage_options or {}))
        return LocalStore(prefix_path)

    # --- paths ----------------------------------------------------------------------

    def get_train_data_path(self, idx: int) -> str:
        return posixpath.join(self.prefix_path, f"{TRAIN_DATA}.{idx}")

    def get_val_data_path(self, idx: int) -> str:
        return posixpath.join(self.prefix_path, f"{VAL_DATA}.{idx}")

    def get_runs_path(self) -> str:
        return posixpath.join(self.prefix_path, "runs")

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self.get_runs_path(), run_id)

    def get_checkpoints_path(self, run_id: str) -> str:
        return posixpath.join(self.get_run_path(run_id), "checkpoint")

    def get_logs_path(self, run_id: str) -> str:
        return posixpath.join(self.get_run_path(run_id), "logs")

    def get_checkpoint_path(self, run_id: str) -> str:
        return posixpath.join(self.get_checkpoints_path(run_id), CHECKPOINT_FILE)

    def get_legacy_checkpoint_path(self, run_id: str) -> str:
        """Where runs written before the ``checkpoint/`` folder kept their checkpoint."""
        return posixpath.join(self.get_run_path(run_id), CHECKPOINT_FILE)

    def get_history_path(self, run_id: str) -> str:
        return posixpath.join(self.get_logs_path(run_id), HISTORY_FILE)

    def find_checkpoint(self, run_id: str) -> str | None:
        """The run's checkpoint file (the current layout's, else the legacy one), if any."""
        for path in (self.get_checkpoint_path(run_id), self.get_legacy_checkpoint_path(run_id)):
            if self.exists(path):
                return path
        return None

    def next_data_index(self) -> int:
        """The first ``i`` with neither ``intermediate_train_data.<i>`` nor ``..val..`` present."""
        idx = 0
        while self.exists(self.get_train_data_path(idx)) or self.exists(
            self.get_val_data_path(idx)
        ):
            idx += 1
        return idx

    # --- I/O, per filesystem -----------------------------------------------------------

    @property
    def spark_can_write(self) -> bool:
        """Whether Spark executors (other processes) can write and read this store."""
        return True

    @abc.abstractmethod
    def url(self, path: str) -> str:
        """The URL Spark writes and reads ``path`` by."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def open_read(self, path: str) -> BinaryIO: ...

    @abc.abstractmethod
    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """Call ``write(file)`` on a temporary file, then move it to ``path``, so a reader
        sees the old file or the new one, never half of one."""

    @abc.abstractmethod
    def rm(self, path: str) -> None:
        """Remove the file or directory tree at ``path``; nothing there is fine."""

    @abc.abstractmethod
    def parquet_dataset(self, path: str) -> Any:
        """The Parquet dataset at ``path`` as a ``pyarrow.dataset.Dataset`` (reads footers
        and rows through this store's filesystem, copying nothing)."""

    @abc.abstractmethod
    def localize(self, path: str) -> str:
        """A local path holding the file or directory ``path`` (a copy where the store is
        not local: the caller owns it and may delete it)."""

    def is_local(self) -> bool:
        """Whether ``localize`` returns the path itself (no copy)."""
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


def _tmp_name(path: str) -> str:
    return f"{path}.tmp-{uuid.uuid4().hex[:8]}"


#: what :func:`_tmp_name` makes of ``path``, as a glob (a writer killed mid-write leaves one)
_TMP_GLOB = "{}.tmp-" + "[0-9a-f]" * 8


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

    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = _tmp_name(path)
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
        # a writer SIGKILLed mid-write (a lost worker, an earlier attempt) left its temp
        # file: the next good write of the same path removes it
        for stale in glob.glob(_TMP_GLOB.format(glob.escape(path))):
            with contextlib.suppress(OSError):
                os.remove(stale)

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


def _dbfs_root() -> str:
    return os.environ.get(DBFS_ROOT_ENV_VAR) or DEFAULT_DBFS_ROOT


def _dbfs_local_path(prefix: str) -> str:
    """``dbfs:/x`` or ``/dbfs/x`` → ``<root>/x`` (root: ``RING_DBFS_ROOT`` or ``/dbfs``)."""
    if prefix.startswith("dbfs:"):
        rest = prefix[len("dbfs:") :].lstrip("/")
    else:
        rest = prefix[len(DEFAULT_DBFS_ROOT) :].lstrip("/")
    return posixpath.join(_dbfs_root(), rest)


@dataclass(frozen=True)
class DBFSLocalStore(LocalStore):
    """Databricks File System through its local FUSE mount (``/dbfs``); Spark writes by
    ``dbfs:/`` URL. With ``RING_DBFS_ROOT`` set elsewhere, Spark writes ``file://``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "prefix_path", _dbfs_local_path(self.prefix_path))

    def url(self, path: str) -> str:
        root = _dbfs_root()
        if root == DEFAULT_DBFS_ROOT:
            return "dbfs:/" + posixpath.relpath(path, root)
        return "file://" + path


@dataclass(frozen=True)
class FsspecStore(Store):
    """A store on any fsspec filesystem, by URL (``s3://bucket/prefix``, ``memory://x``)."""

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

    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        fs, tmp = self.fs, _tmp_name(path)
        fs.makedirs(posixpath.dirname(path), exist_ok=True)
        try:
            with fs.open(tmp, "wb") as f:
                write(f)
            fs.mv(tmp, path)
        finally:
            if fs.exists(tmp):
                fs.rm(tmp)
        for stale in fs.glob(_TMP_GLOB.format(path)):  # as LocalStore.write_atomic
            with contextlib.suppress(OSError, FileNotFoundError):
                fs.rm(stale)

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
        local = os.path.join(tempfile.mkdtemp(prefix="ringtrain-data-"), posixpath.basename(path))
        if self.fs.isdir(path):
            self.fs.get(path.rstrip("/") + "/", local, recursive=True)
        else:
            self.fs.get(path, local)
        return local
