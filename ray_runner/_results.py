"""The driver's side of reports: commit checkpoints, keep the history, call the callbacks.

Rank 0's reports arrive in order, each with its checkpoint index and files when it
uploaded one; the other ranks' progress (their report count and files per index)
arrives beside them. A report with a checkpoint waits until every other rank has
passed the same report (all ranks call ``report()`` equally often, as in Ray Train:
any of them may attach its shard of the checkpoint), so a slow rank's shard is never
left out. A rank that has not reported at all in this attempt is waited for
``RING_CHECKPOINT_WAIT`` seconds (30), then taken to report nothing (a loop that
reports on rank 0 only). Then the checkpoint is committed (its record written,
retention applied) and the report is delivered:
appended to the history, printed with ``verbose=1``, passed to each callback's
``on_report`` and to Ray Tune. Reports after a waiting one wait too, so every consumer
sees them in order. When the attempt ends, a successful one commits what waits (every
rank is done writing); a failed one delivers the waiting reports without their
checkpoints, whose folders the next attempt removes.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from ringcore.launch import get_float

from . import _constants as const
from ._checkpoint import Checkpoint, CheckpointStore

__all__ = ["Reports"]


class Reports:
    """One run's reports as they reach the driver (across attempts)."""

    def __init__(
        self,
        store: CheckpointStore,
        verbose: int,
        callbacks: Sequence[Any] = (),
        on_report: Callable[[dict], None] | None = None,
    ):
        self.store = store
        self.verbose = verbose
        self.callbacks = list(callbacks)
        self.on_report = on_report  # e.g. forwarding to Ray Tune
        self.history: list[dict] = []
        self.wait_s = get_float(const.CHECKPOINT_WAIT_ENV_VAR, const.DEFAULT_CHECKPOINT_WAIT_S)
        self.new_attempt()

    def new_attempt(self) -> None:
        self.pending: list[tuple[float, dict]] = []  # (when it arrived, the report)
        self.peers: dict[int, dict] = {}
        self.size = 1

    def add(self, items: list[dict]) -> None:
        for item in items:
            if "peers" in item:
                self.peers.update(item["peers"])
                self.size = int(item.get("size", self.size))
            else:
                self.pending.append((time.monotonic(), item))
        self._flush(final=None)

    def finish(self, succeeded: bool) -> None:
        """The attempt ended: commit what waits (success) or deliver it without checkpoints."""
        self._flush(final=succeeded)

    def _ready(self, arrived: float, item: dict) -> bool:
        """Whether every other rank has passed the report ``item`` (rank 0's)."""
        for rank in range(1, self.size):
            progress = self.peers.get(rank)
            if progress is None:  # no report yet: a slow rank, or one that never reports
                if time.monotonic() - arrived < self.wait_s:
                    return False
            elif progress["report"] < item["report"]:
                return False
        return True

    def _flush(self, final: bool | None) -> None:
        while self.pending:
            arrived, item = self.pending[0]
            checkpoint = None
            if item["index"] is not None:
                if final is None and not self._ready(arrived, item):
                    return
                if final is not False or self._ready(arrived, item):
                    checkpoint = self._commit(item)
            self.pending.pop(0)
            self._deliver(item["metrics"], checkpoint)

    def _commit(self, item: dict) -> Checkpoint:
        index = item["index"]
        files = {0: item["files"]}
        for rank, progress in sorted(self.peers.items()):
            if index in progress["shards"]:
                files[rank] = progress["shards"][index]
        return self.store.commit(index, item["metrics"], files).checkpoint

    def _deliver(self, metrics: dict, checkpoint: Checkpoint | None) -> None:
        self.history.append(metrics)
        if self.verbose:
            print(self._line(len(self.history), metrics, checkpoint), file=sys.stdout, flush=True)
        for callback in self.callbacks:
            callback.on_report(metrics, checkpoint)
        if self.on_report is not None:
            self.on_report({"metrics": metrics, "checkpoint": checkpoint})

    @staticmethod
    def _line(iteration: int, metrics: dict, checkpoint: Checkpoint | None) -> str:
        parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items()]
        text = f"[RingTrainer] iteration {iteration}: {', '.join(parts)}"
        if checkpoint is None:
            return text
        return f"{text} ({os.path.basename(checkpoint.path.rstrip('/'))})"
