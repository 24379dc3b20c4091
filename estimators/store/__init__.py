"""Where a fit keeps its data and its runs: the :class:`Store` and its checkpoints.

A store is the run-services layer's store of runs (:mod:`ringcore.runs`: whole-file
writes, a run's checkpoints, who may write them and which one a resume reads; shared
with ray_runner) with the Spark side added. ``_layout`` names the data's paths under a
store's prefix, ``_files`` the data's I/O, ``_store`` the stores (local, Databricks
mounts, fsspec URLs) and :meth:`Store.create`, ``_checkpoints`` the bytes a framework
loads, ``_runs`` which run a fit resumes, ``_default`` the store of a fit given none,
``_local_copy`` a worker's copy of a remote dataset.
"""

from ringcore.runs import ClaimUnreadableError, StaleWriterError

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
