"""Where a store keeps what: the paths under its prefix, derived from the prefix alone.

Layout under the prefix (as Horovod's)::

    <prefix>/intermediate_train_data.<i>/          Parquet, one file per process (row groups ~32 MiB)
    <prefix>/intermediate_val_data.<i>/
    <prefix>/.intermediate_data_claim.<i>          the marker by which one fit owns index <i>
    <prefix>/runs/<run_id>/checkpoint/checkpoint.pt  model + optimizer state, epoch, history
    <prefix>/runs/<run_id>/logs/history.json         the per-epoch metrics so far

(Runs written before this layout kept ``runs/<run_id>/checkpoint.pt``; a fit of such a
run resumes from it.) Beside ``checkpoint.pt``: the one before it (``.prev``) and the
claim of the attempt that owns the run (``writer.json``). An ``FsspecStore`` keeps
each writer's checkpoints in a folder of its own instead,
``checkpoint/writer-<fit>-<attempt>/checkpoint.pt``: ``Store.find_checkpoint`` says
which file is the run's checkpoint on any store (``estimators.store._checkpoints``).
"""

from __future__ import annotations

import posixpath
import re

from ._checkpoints import CHECKPOINT_FILE, WRITER_FILE

__all__ = [
    "DATA_CLAIM",
    "HISTORY_FILE",
    "TRAIN_DATA",
    "VAL_DATA",
    "StoreLayout",
    "check_run_id",
]

TRAIN_DATA = "intermediate_train_data"
VAL_DATA = "intermediate_val_data"
DATA_CLAIM = ".intermediate_data_claim"  # hidden: not data itself
HISTORY_FILE = "history.json"
_RUN_ID = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]{0,199}$")


def check_run_id(run_id: str) -> str:
    """``run_id`` if it names one folder under ``<store>/runs/``; else a ValueError saying
    the allowed form (an absolute path or ``..`` would put the run outside the store)."""
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(
            f"run_id {run_id!r} is not a folder name under <store>/runs/: a run_id is 1-200 "
            "letters, digits, '_', '-' and '.' (no '/', no '..', not starting with '.' or "
            "'-'), e.g. 'run_2026-12-03.a'. Pick one with setRunId(...), or leave it unset "
            "for a generated one."
        )
    return run_id


class StoreLayout:
    """The paths of a store (see the module docstring); ``prefix_path`` is the store's."""

    prefix_path: str

    def get_train_data_path(self, idx: int) -> str:
        return posixpath.join(self.prefix_path, f"{TRAIN_DATA}.{idx}")

    def get_val_data_path(self, idx: int) -> str:
        return posixpath.join(self.prefix_path, f"{VAL_DATA}.{idx}")

    def get_data_claim_path(self, idx: int) -> str:
        """The marker a fit creates, exclusively, to own data index ``idx``."""
        return posixpath.join(self.prefix_path, f"{DATA_CLAIM}.{idx}")

    def get_runs_path(self) -> str:
        return posixpath.join(self.prefix_path, "runs")

    def get_run_path(self, run_id: str) -> str:
        return posixpath.join(self.get_runs_path(), check_run_id(run_id))

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

    def get_writer_path(self, run_id: str) -> str:
        return posixpath.join(self.get_checkpoints_path(run_id), WRITER_FILE)
