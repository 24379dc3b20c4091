"""Autotune (``RING_AUTOTUNE=1``): pick the fusion threshold and cycle time online.

The coordinator scores each candidate pair by the allreduce bytes per second it
moved while that pair was in force (a window of responses after a warm-up), tries
every pair of a small grid once, then keeps the best. Each trial is a CSV row in
``RING_AUTOTUNE_LOG``. Horovod uses Bayesian optimisation over the same two knobs; a
grid this small converges in a few hundred steps and is easy to read.
"""

from __future__ import annotations

import csv
import itertools
import time

MB = 1024 * 1024
FUSION_CANDIDATES = (4 * MB, 16 * MB, 64 * MB, 128 * MB)
CYCLE_CANDIDATES_MS = (0.5, 1.0, 2.5, 5.0)


class Autotuner:
    def __init__(
        self,
        log_path: str | None,
        window: int = 20,
        warmup: int = 10,
        fusion_candidates=FUSION_CANDIDATES,
        cycle_candidates_ms=CYCLE_CANDIDATES_MS,
    ):
        self.candidates = list(itertools.product(fusion_candidates, cycle_candidates_ms))
        self.window, self.warmup = window, warmup
        self.log_path = log_path
        self.trial = 0
        self.scores: list[float] = []
        self.done = False
        self._reset()
        if log_path:
            with open(log_path, "w", newline="") as f:
                csv.writer(f).writerow(
                    [
                        "trial",
                        "fusion_threshold_bytes",
                        "cycle_time_ms",
                        "bytes",
                        "seconds",
                        "bytes_per_second",
                        "chosen",
                    ]
                )

    def _reset(self) -> None:
        self.count, self.bytes, self.t0 = 0, 0, time.monotonic()

    def current(self) -> tuple[int, float]:
        """(fusion threshold in bytes, cycle time in seconds) to use now."""
        fusion, cycle_ms = (
            self.candidates[min(self.trial, len(self.candidates) - 1)]
            if not self.done
            else self.best
        )
        return fusion, cycle_ms / 1000.0

    @property
    def best(self) -> tuple[int, float]:
        return self.candidates[max(range(len(self.scores)), key=self.scores.__getitem__)]

    def record(self, nbytes: int) -> bool:
        """Account one response; True when the knobs changed."""
        if self.done:
            return False
        if self.warmup > 0:
            self.warmup -= 1
            self._reset()
            return False
        self.count += 1
        self.bytes += nbytes
        if self.count < self.window:
            return False
        seconds = max(time.monotonic() - self.t0, 1e-9)
        score = self.bytes / seconds
        self.scores.append(score)
        fusion, cycle = self.candidates[self.trial]
        self.trial += 1
        self.done = self.trial >= len(self.candidates)
        self._log(
            [len(self.scores), fusion, cycle, self.bytes, f"{seconds:.6f}", f"{score:.1f}", ""]
        )
        if self.done:
            bf, bc = self.best
            self._log(["best", bf, bc, "", "", f"{max(self.scores):.1f}", "yes"])
        self._reset()
        return True

    def _log(self, row: list) -> None:
        if self.log_path:
            with open(self.log_path, "a", newline="") as f:
                csv.writer(f).writerow(row)
