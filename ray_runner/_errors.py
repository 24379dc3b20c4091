"""The exceptions ray_runner adds under ringcore's root.

::

    ringcore.RingError
    ├── ringcore.WorkerError          a worker's function raised (rank, host, traceback)
    ├── PlacementGroupTimeoutError    the cluster could not place the workers in time
    └── TrainingFailedError           RingTrainer.fit ran out of attempts; carries the WorkerError
"""

from __future__ import annotations

from ringcore import RingError, WorkerError

__all__ = ["PlacementGroupTimeoutError", "TrainingFailedError"]


class PlacementGroupTimeoutError(RingError, TimeoutError):
    """The placement group of the workers was not placed within ``placement_group_timeout_s``."""


class TrainingFailedError(RingError):
    """``RingTrainer.fit()`` gave up: a worker failed and ``max_failures`` allowed no more restarts.

    ``worker_error`` is the first failed rank's :class:`ringcore.WorkerError` (rank, host,
    traceback); ``worker_errors`` holds every rank that failed in the last attempt, by rank
    (the others often fail only because the first one left the ring).
    """

    def __init__(
        self,
        worker_error: WorkerError,
        attempts: int,
        max_failures: int,
        worker_errors: list[WorkerError] | None = None,
    ):
        self.worker_error = worker_error
        self.attempts = attempts
        self.max_failures = max_failures
        self.worker_errors = list(worker_errors) if worker_errors else [worker_error]
        others = [e for e in self.worker_errors if e is not worker_error]
        also = (
            "\n\nAlso failed: "
            + "; ".join(f"rank {e.rank} ({e.error_type}: {e.message})" for e in others)
            if others
            else ""
        )
        super().__init__(
            f"training failed after {attempts} attempt(s) (FailureConfig(max_failures={max_failures})): "
            f"{worker_error}{also}\n\nFix the error above, or raise FailureConfig(max_failures=...) "
            "to restart the workers from the latest checkpoint more often."
        )

    def __reduce__(self):
        return (
            type(self),
            (self.worker_error, self.attempts, self.max_failures, self.worker_errors),
        )
