"""The services of a training run, whichever launcher ran it: where its files go, its
checkpoints, what it records and what it shows.

The estimators (a fit's ``Store``) and ray_runner (a RingTrainer's run folder) both
build on these; what only one of them needs stays in its package.

- :mod:`~ringcore.runs.files`: whole-file writes on POSIX (a locked temporary, fsynced,
  renamed; the folder fsynced), the run lock, fsync of a file or a tree.
- :mod:`~ringcore.runs.stores` and :mod:`~ringcore.runs.layout`: a run's store
  (:class:`RunStore`: a local folder, :class:`LocalRunStore`, or any fsspec URL,
  :class:`FsspecRunStore`) and the paths of its runs.
- :mod:`~ringcore.runs.checkpoints`: who may write a run's checkpoint (claims, fencing
  at the commit point: :class:`StaleWriterError`, :class:`ClaimUnreadableError`) and
  which one a resume reads (the newest whole one, else the one before it).
- :mod:`~ringcore.runs.tracking`: MLflow (params, metrics by step, artifacts, the
  model, the run's end) and :func:`numeric`, the numbers of a metrics dict.
- :mod:`~ringcore.runs.tensorboard`: the scalar event files, written and read back.
- :mod:`~ringcore.runs.progress`: rank 0's progress file and the driver's reader.

Importing it imports none of fsspec, mlflow, tensorboardX, pyarrow or a framework: each
is imported by what uses it. ``import ringcore`` does not import this package.
"""

from __future__ import annotations

from .checkpoints import ClaimUnreadableError, StaleWriterError
from .files import fsync_path, fsync_tree, write_file
from .layout import RunLayout, check_run_id
from .progress import ProgressFile, RunWatcher
from .stores import FsspecRunStore, LocalRunStore, RunStore
from .tensorboard import EventWriter, ScalarWriter, read_scalars
from .tracking import MlflowLog, active_run, flatten, log_model, numeric

__all__ = [
    "ClaimUnreadableError",
    "EventWriter",
    "FsspecRunStore",
    "LocalRunStore",
    "MlflowLog",
    "ProgressFile",
    "RunLayout",
    "RunStore",
    "RunWatcher",
    "ScalarWriter",
    "StaleWriterError",
    "active_run",
    "check_run_id",
    "flatten",
    "fsync_path",
    "fsync_tree",
    "log_model",
    "numeric",
    "read_scalars",
    "write_file",
]
