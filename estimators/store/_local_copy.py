"""A worker's local copy of a dataset in a remote store (``FsspecStore(local_copy=True)``).

:func:`copy_to_local` fetches a file or a folder into a new temporary directory; a copy
that fails leaves nothing behind, and a full local disk raises
:class:`LocalDiskFullError` naming the directory, the sizes and the fix.
"""

from __future__ import annotations

import errno
import os
import posixpath
import shutil
import tempfile
from typing import Any

__all__ = ["LocalDiskFullError", "copy_to_local"]


class LocalDiskFullError(RuntimeError):
    """A worker's local disk filled up while it copied the training data from a remote
    store (not an OSError on purpose: the store itself is fine, and the estimator's
    store-failure message must not claim otherwise)."""


def copy_to_local(fs: Any, path: str) -> str:
    """A copy of ``path`` (on the fsspec filesystem ``fs``) on this machine's disk, in a
    new temporary directory that the caller removes."""
    folder = tempfile.mkdtemp(prefix="ringtrain-data-")
    local = os.path.join(folder, posixpath.basename(path))
    try:
        if fs.isdir(path):
            fs.get(path.rstrip("/") + "/", local, recursive=True)
        else:
            fs.get(path, local)
    except BaseException as exc:
        shutil.rmtree(folder, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            raise LocalDiskFullError(_disk_full(fs, path, folder)) from exc
        raise
    return local


def _disk_full(fs: Any, path: str, folder: str) -> str:
    root = os.path.dirname(folder)
    try:
        needed = f"{int(fs.du(path)):,} bytes"
    except Exception:  # the message must not fail: the size is only a hint
        needed = "its size"
    free = shutil.disk_usage(root).free
    return (
        f"this worker's local disk is full: copying the training data {path} from the "
        f"store to {folder} needs {needed}, and {root} (the worker's temporary directory, "
        f"TMPDIR) has {free:,} bytes free. The store is fine. Free space there, point "
        "the executors' TMPDIR at a larger disk (spark.executorEnv.TMPDIR=<dir> when the "
        "SparkSession is created), or use a store the workers read in place (a path "
        "every node mounts)."
    )
