"""The Spark jobs of ``run_elastic``: one single-task job per slot, each submitted from
a driver thread of its own, so that a lost task fails only its own job.

What differs between a classic session and a Spark Connect client is only how one
slot's job is submitted and how they are all stopped:

- classic (:class:`ClassicSlotJobs`): ``sc.parallelize([slot], 1).mapPartitions(task)``
  under one job group, stopped by ``sc.cancelJobGroup``;
- Spark Connect (:class:`ConnectSlotJobs`): no SparkContext, so each slot is
  ``spark.range(slot, slot + 1, 1, 1).mapInArrow(...)`` (the same task function,
  wrapped by :func:`~spark_runner._connect.arrow_task`, its result in chunks), under
  one operation tag (``spark.addTag`` is per thread, so each thread adds it), stopped
  by ``spark.interruptTag``.

Each job's outcome (``"ok"`` and the worker's result blob, or ``"error"`` and the
exception) goes to :attr:`SlotJobs.outcomes`, which the elastic loop drains.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from typing import Any

from ._connect import RESULT_SCHEMA, arrow_task, reassemble

#: how long ``cancel`` waits for the slots' threads to end
CANCEL_WAIT_S = 10.0


class SlotJobs:
    """One single-task Spark job per slot, each on its own driver thread; a subclass
    says how one job runs (:meth:`_run_one`) and how they are all stopped (:meth:`_stop`)."""

    def __init__(self, task: Any):
        self.task = task  # an RDD partition function over the one-element partition [slot]
        self.outcomes: queue.Queue[tuple[int, str, Any]] = queue.Queue()
        self.threads: list[threading.Thread] = []
        self._stopped = threading.Event()

    def start(self, slots: range) -> None:
        for slot in slots:
            thread = threading.Thread(
                target=self._one, args=(slot,), name=f"ringtrain-elastic-{slot}", daemon=True
            )
            self.threads.append(thread)
            thread.start()

    def _one(self, slot: int) -> None:
        if self._stopped.is_set():
            return
        try:
            self.outcomes.put((slot, "ok", self._run_one(slot)))
        except Exception as exc:
            self.outcomes.put((slot, "error", exc))

    def cancel(self) -> None:
        """Stop every slot's job (the tasks still waiting to join, or still running) and
        wait up to :data:`CANCEL_WAIT_S` for their threads; a job submitted while the
        first stop went out is stopped by the next."""
        self._stopped.set()
        deadline = time.monotonic() + CANCEL_WAIT_S
        while True:
            with contextlib.suppress(Exception):  # a dead server has nothing left to stop
                self._stop()
            alive = [t for t in self.threads if t.is_alive()]
            if not alive or time.monotonic() >= deadline:
                return
            alive[0].join(timeout=min(1.0, max(deadline - time.monotonic(), 0.0)))

    def _run_one(self, slot: int) -> bytes:
        raise NotImplementedError

    def _stop(self) -> None:
        raise NotImplementedError


class ClassicSlotJobs(SlotJobs):
    """Jobs of a classic SparkContext, under one job group."""

    def __init__(self, sc: Any, group: str, description: str, task: Any):
        super().__init__(task)
        self.sc, self.group, self.description = sc, group, description

    def _run_one(self, slot: int) -> bytes:
        self.sc.setJobGroup(self.group, self.description, interruptOnCancel=True)
        return self.sc.parallelize([slot], 1).mapPartitions(self.task).collect()[0]

    def _stop(self) -> None:
        self.sc.cancelJobGroup(self.group)


class ConnectSlotJobs(SlotJobs):
    """Jobs of a Spark Connect client, as ``mapInArrow`` operations under one tag."""

    def __init__(self, spark: Any, tag: str, task: Any):
        super().__init__(task)
        self.spark, self.tag = spark, tag
        self._arrow_task = arrow_task(task)

    def _run_one(self, slot: int) -> bytes:
        self.spark.addTag(self.tag)  # this thread's operations only
        try:
            frame = self.spark.range(slot, slot + 1, 1, 1).mapInArrow(
                self._arrow_task, RESULT_SCHEMA
            )
            return reassemble(frame.toArrow(), 1)[0]
        finally:
            self.spark.removeTag(self.tag)

    def _stop(self) -> None:
        self.spark.interruptTag(self.tag)
