"""What a filesystem does for a store's data, beside a run's files.

A run's files (read, write whole, create exclusively, remove) are the run-services
layer's :class:`ringcore.runs.RunStore`; a store adds what Spark and the workers' readers
need: the URL Spark writes Parquet by, the options a reader opens it with, the Parquet
datasets and, where its workers cannot read in place, a copy on the local disk.
"""

from __future__ import annotations

import abc
from typing import Any

__all__ = ["StoreFiles"]


class StoreFiles(abc.ABC):
    """The data I/O of a store, per filesystem (see the module docstring)."""

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
    def parquet_dataset(self, path: str) -> Any:
        """The Parquet dataset at ``path`` as a ``pyarrow.dataset.Dataset`` (reads footers
        and rows through this store's filesystem, copying nothing)."""

    @abc.abstractmethod
    def localize(self, path: str) -> str:
        """A local path holding the file or directory ``path`` (a copy where the store is
        not local: the caller owns it and may delete it)."""
