"""The Store: where an estimator keeps its intermediate Parquet data and its runs.

Layout under the prefix (as Horovod's)::

    <prefix>/intermediate_train_data.<i>/    Parquet, one file (one row group) per process
    <prefix>/intermediate_val_data.<i>/
    <prefix>/runs/<run_id>/checkpoint.pt     model + optimizer state, epoch, history
    <prefix>/runs/<run_id>/history.json      the per-epoch metrics so far

``Store.create(prefix)`` picks the implementation from the prefix; this first cut
has the local filesystem. A Store is plain, picklable data: it crosses to the
workers, which write checkpoints through it.
"""

from __future__ import annotations

import abc
import json
import os
import posixpath
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO

__all__ = ["LocalStore", "Store"]

TRAIN_DATA = "intermediate_train_data"
VAL_DATA = "intermediate_val_data"
CHECKPOINT_FILE = "checkpoint.pt"
HISTORY_FILE = "history.json"


class Store(abc.ABC):
    """Base of every store; make one with :meth:`Store.create`.

    Paths derive from ``prefix_path`` here; subclasses do the I/O.
    """

    prefix_path: str

    @staticmethod
    def create(prefix_path: str) -> Store:
        """A store for ``prefix_path``: a local directory or a ``file://`` URL."""
        if not isinstance(prefix_path, str) or not prefix_path:
            raise ValueError(f"Store.create takes a non-empty path or URL, got {prefix_path!r}")
        if prefix_path.startswith("file://"):
            return LocalStore(prefix_path[len("file://") :])
        if "://" in prefix_path:
            scheme = prefix_path.split("://", 1)[0]
            raise ValueError(
                f"Store.create({prefix_path!r}): the {scheme}:// scheme is not supported yet; "
                "this version stores on the local filesystem. Pass a local directory."
            )
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

    def get_checkpoint_path(self, run_id: str) -> str:
        return posixpath.join(self.get_run_path(run_id), CHECKPOINT_FILE)

    def get_history_path(self, run_id: str) -> str:
        return posixpath.join(self.get_run_path(run_id), HISTORY_FILE)

    def next_data_index(self) -> int:
        """The first ``i`` with neither ``intermediate_train_data.<i>`` nor ``..val..`` present."""
        idx = 0
        while self.exists(self.get_train_data_path(idx)) or self.exists(
            self.get_val_data_path(idx)
        ):
            idx += 1
        return idx

    # --- I/O, per filesystem -----------------------------------------------------------

    @abc.abstractmethod
    def url(self, path: str) -> str:
        """The URL Spark and petastorm read ``path`` by."""

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def open_read(self, path: str) -> BinaryIO: ...

    @abc.abstractmethod
    def write_atomic(self, path: str, write: Callable[[BinaryIO], object]) -> None:
        """Call ``write(file)`` on a temporary file, then move it to ``path``, so a reader
        sees the old file or the new one, never half of one."""

    def write_json(self, path: str, value: Any) -> None:
        self.write_atomic(path, lambda f: f.write(json.dumps(value, indent=1).encode()))

    def read_json(self, path: str) -> Any:
        with self.open_read(path) as f:
            return json.loads(f.read())


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
        tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as f:
                write(f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)
