"""Where a run keeps what under its store's prefix, derived from the prefix alone.

Layout under the prefix (as Horovod's estimators keep it)::

    <prefix>/runs/<run_id>/checkpoint/checkpoint.pt  model + optimizer state, epoch, history
    <prefix>/runs/<run_id>/logs/history.json         the per-epoch metrics so far
    <prefix>/runs/<run_id>/logs/progress.json        rank 0's latest step (``progress``)
    <prefix>/runs/<run_id>/logs/events.out.tfevents.* TensorBoard scalars (``tensorboard``)

(Runs written before this layout kept ``runs/<run_id>/checkpoint.pt``; a resume of such
a run reads it.) Beside ``checkpoint.pt``: the one before it (``.prev``) and the claim
of the writer that owns the run (``writer.json``). A per-writer store keeps each writer's
checkpoints in a folder of its own instead, ``checkpoint/writer-<fit>-<attempt>/
checkpoint.pt``: ``RunStore.find_checkpoint`` says which file is the run's checkpoint on
any store (:mod:`ringcore.runs.checkpoints`).
"""

from __future__ import annotations

import posixpath
import re

from .checkpoints import CHECKPOINT_FILE, WRITER_FILE

__all__ = ["HISTORY_FILE", "PROGRESS_FILE", "RunLayout", "check_run_id"]

HISTORY_FILE = "history.json"
PROGRESS_FILE = "progress.json"
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


class RunLayout:
    """The paths of a store's runs (see the module docstring); ``prefix_path`` is the
    store's."""

    prefix_path: str

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

    def get_progress_path(self, run_id: str) -> str:
        return posixpath.join(self.get_logs_path(run_id), PROGRESS_FILE)

    def get_writer_path(self, run_id: str) -> str:
        return posixpath.join(self.get_checkpoints_path(run_id), WRITER_FILE)
