"""Where a fit keeps its data and its runs: the :class:`Store` and its checkpoints.

``_layout`` names the paths under a store's prefix, ``_files`` the I/O a filesystem does
for it, ``_store`` the stores (local, Databricks mounts, fsspec URLs) and
:meth:`Store.create`, ``_checkpoints`` who may write a run's checkpoint and which one a
resume reads, ``_atomic`` whole-file writes on POSIX, ``_runs`` which run a fit
resumes, ``_default`` the store of a fit given none.
"""

from ._checkpoints import ClaimUnreadableError, StaleWriterError
from ._default import default_store
from ._local_copy import LocalDiskFullError
from ._store import DBFSLocalStore, FsspecStore, LocalStore, Store, VolumeStore

__all__ = [
    "ClaimUnreadableError",
    "DBFSLocalStore",
    "FsspecStore",
    "LocalDiskFullError",
    "LocalStore",
    "StaleWriterError",
    "Store",
    "VolumeStore",
    "default_store",
]
