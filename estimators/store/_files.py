"""What a filesystem does for a store: the I/O every :class:`~._store.Store` implements.

A store reads and writes whole files (a temporary of the writer's own moved into place),
creates a file exclusively (the data-index claims), removes trees, opens Parquet datasets
and, where its workers cannot read in place, copies a dataset to the local disk.
"""

from __future__ import annotations

import abc
import json
from collections.abc import Callable
from typing import Any, BinaryIO

__all__ = ["StoreFiles"]


class StoreFiles(abc.ABC):
    """The I/O of a store, per filesystem (see the module docstring)."""

    @property
    def spark_can_write(self) -> bool:
        """Whether Spark executors (other processes) can write and read this store."""
        return True

    def read_options(self) -> dict[str, Any] | None:
        """The ``storage_options`` a reader opens this store's URLs with (None: a path)."""
        return None

    def reads_in_place(self) -> bool:
        """Whether workers read the Parquet where it lies (else :meth:`localize` copies)."""
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
