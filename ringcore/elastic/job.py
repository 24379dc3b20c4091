"""The launcher's control loop of one elastic job: form, watch, re-form, stop.

Every elastic launcher (``ringcore.testing.run_workers(elastic=True)``,
``spark_runner.run_elastic``, ray_runner's elastic group and ``ElasticRayExecutor``)
runs its job through one :class:`ElasticJob` over an
:class:`~ringcore.elastic.driver.ElasticDriver`. The launcher gives it what only the
launcher knows:

- *who is alive* and, to grow, *start one more* (passed on to the driver:
  :mod:`ringcore.elastic.policy` says what they return);
- *wait*: ``wait(timeout_s)`` blocks up to that long for its workers and takes in what
  they sent (results, failures) — raising ends the job (a worker's own error);
- *finished*: whether the job is over (default: every member of the ring is done).

The job forms the first ring (:meth:`ElasticJob.start` with the ranks the launcher
placed itself, or :meth:`ElasticJob.form` from the workers that show up), watches it
(:meth:`ElasticJob.watch`: wait, re-form by the policy, grow, until finished or the
policy gives up) and, used as a context manager, tells every waiting worker to stop when
the launcher's side fails. :func:`late_worker_env` is the environment of a worker
started into a running job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from .. import _config as cfg
from .._errors import RingError
from .driver import ElasticDriver
from .policy import AliveFn, ElasticPolicy, StartMoreFn

__all__ = ["ElasticJob", "late_worker_env"]

log = logging.getLogger("ringtrain.ringcore.elastic")

#: how often, by default, the loop looks at the workers and the driver (seconds)
POLL_S = 0.1
#: the reason the waiting workers read when the launcher's own side fails
STOPPED_BY_DRIVER = "the elastic job was stopped by the driver"


class ElasticJob:
    """One elastic job on the launcher's side (see the module docstring).

    ``name`` starts the messages (``"run_elastic of train"``). ``stop_raises``: once the
    policy gave the job up, :meth:`watch` raises :class:`RingError` with the reason;
    False leaves it to the workers, which read the abort and fail. ``on_generation``
    gets ``(generation, workers)`` of each ring published.
    """

    def __init__(
        self,
        store: Any,
        alive: AliveFn,
        policy: ElasticPolicy,
        *,
        wait: Callable[[float], None],
        finished: Callable[[], bool] | None = None,
        start_more: StartMoreFn | None = None,
        recheck: Callable[[], None] | None = None,
        name: str = "the elastic job",
        poll_s: float = POLL_S,
        stop_raises: bool = True,
        on_generation: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.driver = ElasticDriver(
            store, alive, policy, start_more=start_more, recheck=recheck, clock=clock
        )
        self.wait, self.name, self.poll_s = wait, name, poll_s
        self.finished = finished if finished is not None else self._members_done
        self.stop_raises, self.clock = stop_raises, clock
        self.on_generation = on_generation or (lambda generation, workers: None)

    def __enter__(self) -> ElasticJob:
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        """On any exception (Ctrl-C too) once a ring was formed or announced: publish an
        abort naming it, so no worker waits for a generation that never comes and each
        says why it stopped; the driver's log gets the traceback."""
        if kind is not None and (self.driver.members or self.driver.generation):
            cause = f"{kind.__name__}: {exc}" if str(exc) else kind.__name__
            log.warning("%s: the launcher's side failed", self.name, exc_info=(kind, exc, tb))
            self.driver.abort(f"{STOPPED_BY_DRIVER} ({cause})")

    # -- forming the first ring -------------------------------------------------------

    def start(self, members: list[str]) -> None:
        """The first ring is ``members``, whom the launcher started with their ranks."""
        self.driver.start(members)

    def form(self, want: int, within_s: float, too_few: Callable[[int], Exception]) -> list[str]:
        """Publish the first ring once ``want`` workers are alive or, after ``within_s``
        seconds, at least the policy's minimum; else raise ``too_few(count)``. Returns
        the members."""
        self.driver.start([])
        deadline = self.clock() + within_s
        while True:
            live = self.driver.workers()
            late = self.clock() > deadline
            if len(live.ids) >= want or (late and len(live.ids) >= self.driver.policy.min_workers):
                self.driver.publish(list(live.ids), list(live.hosts))
                self.on_generation(self.driver.generation, len(self.driver.members))
                return list(self.driver.members)
            if late:
                raise too_few(len(live.ids))
            self.wait(self.poll_s)

    # -- watching it ------------------------------------------------------------------

    def watch(self) -> list[str]:
        """Wait, re-form and grow by the policy until :attr:`finished`; the final members."""
        while True:
            self.wait(self.poll_s)
            if self.finished():
                return list(self.driver.members)
            if self.driver.poll():
                self.on_generation(self.driver.generation, len(self.driver.members))
            if self.driver.stopped and self.stop_raises:
                raise RingError(f"{self.name} stopped: {self.driver.stopped}")

    def _members_done(self) -> bool:
        members = self.driver.members
        done = self.driver.workers().done
        return bool(members) and all(m in done for m in members)


def late_worker_env(
    store_addr: str,
    store_port: int,
    worker_id: str,
    *,
    secret: str | None = None,
    host: str | None = None,
) -> dict[str, str]:
    """The ``RING_*`` variables of a worker started into a running elastic job: its
    ``init()`` waits for the first generation that lists ``worker_id`` and takes its
    rank there (``secret``: the job's; ``host``: the address its peers reach)."""
    env = {
        cfg.STORE_ADDR_ENV_VAR: store_addr,
        cfg.STORE_PORT_ENV_VAR: str(store_port),
        cfg.STORE_EXTERNAL_ENV_VAR: "1",
        cfg.ELASTIC_LATE_ENV_VAR: "1",
        cfg.RANK_ENV_VAR: "0",
        cfg.SIZE_ENV_VAR: "1",
        cfg.ELASTIC_ENV_VAR: "1",
        cfg.WORKER_ID_ENV_VAR: worker_id,
    }
    if secret:
        env[cfg.SECRET_KEY_ENV_VAR] = secret
    if host is not None:
        env[cfg.HOSTNAME_ENV_VAR] = host
    return env
