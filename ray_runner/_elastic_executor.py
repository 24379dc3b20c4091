"""``ElasticRayExecutor``: Horovod's elastic executor on Ray, on RingTrainer's elastic group.

The shape is Horovod's::

    settings = ElasticRayExecutor.create_settings(verbose=True)
    executor = ElasticRayExecutor(settings, use_gpu=False, cpus_per_slot=1)
    executor.start()
    results = executor.run(train_fn, callbacks=[print])

``RayExecutor(settings, min_workers=..., max_workers=...)`` runs the same thing. The
workers are the actors of :class:`ray_runner._elastic_group.ElasticGroup` (one actor per
slot, no placement group, so that slots come and go one at a time); ``train_fn`` uses
``ringcore.torch.elastic`` as it used ``horovod.torch.elastic``. ``run`` returns the
return values of the workers that finished, ordered by their rank in the final ring;
``ray_runner.ray_logger.log(value)`` on a worker reaches every callback.

Differences from Horovod (also in docs/migrating-from-horovod.md): below ``min_workers``
the run stops at once instead of waiting ``elastic_timeout`` for hosts to come back
(``elastic_timeout`` bounds how long a worker waits for the next ring); Ray places a
replacement actor wherever resources are free, so ``cooldown_range`` (a host blacklist)
is checked and has no effect; ``override_discovery=False`` (a custom host discovery
script) is refused; ``max_workers=None`` means as many as the cluster holds at ``run``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

import ray

from ringcore import RingError, Topology, WorkerError
from ringcore.launch import (
    ELASTIC_TIMEOUT_ENV_VAR,
    RANK_ENV_VAR,
    ElasticNames,
    ElasticPolicy,
    ShippedScript,
    check_elastic_limits,
    get_float,
)

from . import _constants as const
from ._cluster import check_cluster_gpus, require_ray
from ._config import ScalingConfig
from ._elastic_group import ElasticGroup, _Member
from ._log_callbacks import check_callbacks
from ._session import SessionSetup
from ._settings import RaySettings, create_elastic_settings

log = logging.getLogger("ringtrain.ray_runner")

__all__ = ["ElasticRayExecutor", "check_elastic_sizes"]


RAY_NAMES = ElasticNames(max_none="None (as many as the cluster holds)")


def check_elastic_sizes(
    min_workers: Any, max_workers: Any, reset_limit: Any, cooldown_range: Any, elastic_timeout: Any
) -> None:
    """Horovod's elastic arguments, checked before anything starts."""
    check_elastic_limits(min_workers, max_workers, reset_limit, elastic_timeout, names=RAY_NAMES)
    if cooldown_range is not None:
        ok = (
            isinstance(cooldown_range, (list, tuple))
            and len(cooldown_range) == 2
            and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in cooldown_range)
            and 0 <= cooldown_range[0] <= cooldown_range[1]
        )
        if not ok:
            raise ValueError(
                f"cooldown_range must be (min_seconds, max_seconds) with 0 <= min <= max, "
                f"got {cooldown_range!r}"
            )


@dataclass
class _Call:
    """What every elastic worker runs: ``fn(*args, **kwargs)``, returned with the final rank."""

    fn: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __call__(self) -> tuple[int, Any]:
        value = self.fn(*self.args, **self.kwargs)
        return int(os.environ.get(RANK_ENV_VAR, "-1")), value


class _ExecutorGroup(ElasticGroup):
    """The elastic group running one plain function: keeps results, feeds callbacks."""

    def __init__(
        self,
        scaling: ScalingConfig,
        env: dict[str, str],
        reset_limit: int | None,
        start_timeout_s: float,
        callbacks: list[Callable[[Any], Any]],
    ):
        super().__init__(scaling)
        self.timeout_s = start_timeout_s
        self.extra_env = env
        self.reset_limit = reset_limit
        self.callbacks = callbacks
        self.results: dict[str, tuple[int, Any]] = {}

    def _policy(self) -> ElasticPolicy:
        """The group's policy, and the job stops after ``reset_limit`` re-formations."""
        return replace(super()._policy(), reset_limit=self.reset_limit)

    def _env(self, wid: str, member: _Member, rank: int) -> dict[str, str]:
        return {**super()._env(wid, member, rank), **self.extra_env}

    def _late_env(self, wid: str, host: str) -> dict[str, str]:
        return {**super()._late_env(wid, host), **self.extra_env}

    def _launch(
        self,
        member: _Member,
        loop: Callable,
        setup: SessionSetup,
        topology: Topology,
        env: dict[str, str],
    ) -> None:
        member.actor.setup.remote(topology, env)  # actor calls run in order
        member.ref = member.actor.run.remote(loop)

    def _finish(self, wid: str, ref: Any) -> WorkerError | None:
        try:
            kind, value = ray.get(ref)
        except ray.exceptions.RayError:
            kind, value = "lost", None
        if kind == "ok":
            self.results[wid] = value
        return super()._finish(wid, ref)

    def _drain(self, on_reports: Callable[[list[dict]], None]) -> None:
        """Hand what the members logged (``ray_logger.log``) to the callbacks."""
        refs = [m.actor.drain_logs.remote() for m in self.members.values()]
        for ref in refs:
            try:
                values = ray.get(ref, timeout=self.ping_timeout_s)
            except (ray.exceptions.RayError, TimeoutError) as exc:
                log.debug("could not collect an elastic worker's logged values: %s", exc)
                continue
            for value in values:
                for callback in self.callbacks:
                    callback(value)


class ElasticRayExecutor:
    """Horovod's ``horovod.ray.ElasticRayExecutor``: an elastic job on Ray actors.

    ``settings`` (from :meth:`create_settings`) gives ``min_num_proc`` / ``max_num_proc``,
    ``reset_limit``, ``elastic_timeout``, ``timeout_s`` and ``nics``; the keyword
    arguments ``min_workers`` / ``max_workers`` / ``reset_limit`` / ``cooldown_range`` /
    ``elastic_timeout`` (the shape of ``RayExecutor``'s elastic mode) override them.
    """

    group_cls: type = _ExecutorGroup  # seam: a test may inject a different group

    create_settings = staticmethod(create_elastic_settings)

    def __init__(
        self,
        settings: RaySettings | None = None,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float | None = None,
        env_vars: dict[str, str] | None = None,
        override_discovery: bool = True,
        *,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] | None = None,
        elastic_timeout: float | None = None,
    ):
        settings = settings if settings is not None else create_elastic_settings()
        if not isinstance(settings, RaySettings):
            raise TypeError(
                f"settings must come from ElasticRayExecutor.create_settings(...), got "
                f"{type(settings).__name__}; ringtrain does not read Horovod's ElasticSettings"
            )
        if override_discovery is not True:
            raise ValueError(
                "override_discovery=False (a custom HostDiscovery in settings.discovery) is not "
                "supported: ringtrain always finds slots through Ray's own scheduling. Drop "
                "override_discovery and size the job with min_workers / max_workers"
            )
        if gpus_per_slot is not None and not use_gpu:
            raise ValueError(f"gpus_per_slot={gpus_per_slot!r} needs use_gpu=True")
        for name, value in (("cpus_per_slot", cpus_per_slot), ("gpus_per_slot", gpus_per_slot)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ValueError(f"{name} must be a positive number, got {value!r}")
        if env_vars is not None and not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env_vars.items()
        ):
            raise TypeError("env_vars must map str to str, e.g. {'OMP_NUM_THREADS': '1'}")
        self.min_workers = min_workers if min_workers is not None else settings.min_num_proc or 1
        self.max_workers = max_workers if max_workers is not None else settings.max_num_proc
        self.reset_limit = reset_limit if reset_limit is not None else settings.reset_limit
        self.elastic_timeout = (
            elastic_timeout if elastic_timeout is not None else settings.elastic_timeout
        )
        check_elastic_sizes(
            self.min_workers,
            self.max_workers,
            self.reset_limit,
            cooldown_range,
            self.elastic_timeout,
        )
        if cooldown_range is not None:
            log.debug("cooldown_range=%r has no effect: Ray places replacements", cooldown_range)
        self.cooldown_range = cooldown_range
        self.settings = settings
        self.use_gpu = bool(use_gpu)
        self.cpus_per_slot = cpus_per_slot
        self.gpus_per_slot = (gpus_per_slot or 1) if use_gpu else None
        self.env_vars = dict(env_vars or {})
        self._started = False

    def start(self, extra_env_vars: dict[str, str] | None = None) -> None:
        """Check that Ray runs and can hold ``min_workers``; workers start in ``run``."""
        require_ray("start()")
        check_cluster_gpus(self.gpus_per_slot, "ElasticRayExecutor")
        self.env_vars.update(extra_env_vars or {})
        self._started = True

    def run(self, worker_fn: Callable, callbacks: list[Callable] | None = None) -> list:
        """``worker_fn()`` on every worker of the elastic job; the finished workers' return
        values ordered by rank. Every callback gets every value a worker logs with
        ``ray_runner.ray_logger.log``."""
        return self.run_fn(worker_fn, (), {}, callbacks)

    def run_fn(
        self,
        fn: Callable | str | os.PathLike,
        args: tuple,
        kwargs: dict,
        callbacks: list[Callable] | None,
    ) -> list:
        """``fn(*args, **kwargs)`` as :meth:`run` (``RayExecutor``'s elastic mode calls this)."""
        if isinstance(fn, str | os.PathLike | ShippedScript):
            raise NotImplementedError(
                "an elastic job runs functions, not scripts: a script's own process cannot "
                "re-form with the ring's generations. Run the script on a fixed group "
                "(RayExecutor(num_workers=N).run(path, args=[...])), or call its main() "
                "from a function that uses ringcore.torch.elastic"
            )
        if not callable(fn):
            raise TypeError(f"run takes a callable, got {type(fn).__name__}")
        hooks = check_callbacks(callbacks)
        if not self._started:
            raise RingError("this ElasticRayExecutor is not started; call start() first")
        group = self.group_cls(
            self._scaling(),
            self._worker_env(),
            self.reset_limit,
            self.settings.placement_group_timeout_s,
            hooks,
        )
        poll_s = get_float(const.REPORT_POLL_INTERVAL_ENV_VAR, const.DEFAULT_REPORT_POLL_INTERVAL_S)
        call = _Call(fn, tuple(args), dict(kwargs))
        errors = group.run(call, cast(SessionSetup, None), lambda _: None, poll_s)
        if errors:
            raise errors[0]
        return [value for _, value in sorted(group.results.values(), key=lambda rv: rv[0])]

    def shutdown(self) -> None:
        """Nothing outlives ``run`` (its actors are gone when it returns); safe to call twice."""
        self._started = False

    # -- internals -----------------------------------------------------------------

    def _worker_env(self) -> dict[str, str]:
        return {
            **self.settings.worker_env(),
            ELASTIC_TIMEOUT_ENV_VAR: f"{self.elastic_timeout:g}",
            **self.env_vars,
        }

    def _scaling(self) -> ScalingConfig:
        resources: dict[str, float] = {"CPU": self.cpus_per_slot}
        if self.use_gpu and self.gpus_per_slot:
            resources["GPU"] = self.gpus_per_slot
        high = self.max_workers if self.max_workers is not None else self._cluster_slots()
        return ScalingConfig(
            num_workers=(self.min_workers, max(high, self.min_workers)),
            use_gpu=self.use_gpu,
            resources_per_worker=resources,
        )

    def _cluster_slots(self) -> int:
        """``max_workers=None``: as many slots as the cluster's resources hold now."""
        total = ray.cluster_resources()
        slots = math.floor(total.get("CPU", 0) / self.cpus_per_slot)
        if self.use_gpu and self.gpus_per_slot:
            slots = min(slots, math.floor(total.get("GPU", 0) / self.gpus_per_slot))
        return max(1, slots)
