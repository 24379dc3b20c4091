"""``RayExecutor``: N Ray actors in one placement group that form a ringcore ring.

Ray must already be running in this process: call ``ray.init()`` (a local instance)
or ``ray.init(address="auto")`` (join a cluster) before :meth:`RayExecutor.start`.
Worker actors share the driver's Python environment; no ``runtime_env`` is needed.

Ranks follow the actors' node IPs: ranks on one node are contiguous, so local ranks
and cross ranks come out as Horovod defines them (:func:`ringcore.topology_from_hosts`).
Rank 0's actor hosts the job's store and picks a free port on its node for the user's
own process group; every actor gets :func:`ringcore.worker_env` and torchrun's variables
(:func:`ringcore.launch.torchrun_env`: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...,
``MASTER_ADDR``/``MASTER_PORT``) in its ``os.environ`` before any function runs, so
``ringcore.init()`` needs nothing else and a ``torch.distributed`` program's
``init_process_group()`` (env://) forms the job's group unchanged. When every rank is on
one node the ring talks over 127.0.0.1; a single rank needs no TCP store at all.
``run`` also takes the path of a Python file and its arguments (``ringcore.launch.ShippedScript``).
"""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from typing import Any

import ray
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ringcore import RingError, topology_from_hosts, worker_env
from ringcore.launch import (
    HOSTNAME_ENV_VAR,
    ShippedScript,
    get_float,
    host_major_order,
    is_script,
    new_secret,
    torchrun_env,
)

from . import _constants as const
from ._cluster import check_cluster_gpus, cuda_visible_devices, require_ray
from ._elastic_executor import ElasticRayExecutor
from ._envelopes import collect
from ._errors import PlacementGroupTimeoutError
from ._log_callbacks import check_callbacks, collect_logging
from ._settings import RaySettings, create_settings
from ._worker import CONTROL_GROUP, RingWorker

log = logging.getLogger("ringtrain.ray_runner")

__all__ = ["RayExecutor"]

_LOOPBACK = "127.0.0.1"


def _positive(name: str, value: Any, *, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"{name} must be a positive number, got {value!r}")


class RayExecutor:
    """Run functions on ``num_workers`` ranks, each a Ray actor, as Horovod's ``RayExecutor``.

    ``num_workers`` actors are packed into one placement group (one bundle per worker,
    ``placement_strategy="PACK"``); alternatively ``num_hosts`` x ``num_workers_per_host``
    places one bundle per host with ``STRICT_SPREAD``. ``start()`` waits at most
    ``placement_group_timeout_s`` (default ``$RING_PLACEMENT_GROUP_TIMEOUT`` or 100 s).
    A worker's exception reaches the driver as :class:`ringcore.WorkerError`; other
    ranks may then still wait in a collective, so call ``shutdown()`` before reusing it.

    Horovod's shapes work: ``RayExecutor(settings, num_workers=...)`` with ``settings``
    from :meth:`create_settings` (``timeout_s``, ``placement_group_timeout_s``, ``nics``;
    see ``ray_runner._settings``), ``RayExecutor(4)`` (the count, positionally),
    ``use_current_placement_group=False``, and the elastic mode ``min_workers=`` /
    ``max_workers=`` / ``reset_limit=`` / ``cooldown_range=`` / ``elastic_timeout=``, which
    runs each ``run`` as an :class:`ElasticRayExecutor` job.
    """

    worker_cls: type = RingWorker  # seam: a test may start a different worker class

    create_settings = staticmethod(create_settings)

    def __init__(
        self,
        settings: RaySettings | int | None = None,
        num_workers: int | None = None,
        num_hosts: int | None = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: float | None = None,
        use_current_placement_group: bool = True,
        min_workers: int | None = None,
        max_workers: int | None = None,
        reset_limit: int | None = None,
        cooldown_range: tuple[float, float] | None = None,
        elastic_timeout: float | None = None,
        override_discovery: bool = True,
        *,
        resources_per_worker: dict[str, float] | None = None,
        placement_strategy: str = "PACK",
        placement_group_timeout_s: float | None = None,
        placement_group: PlacementGroup | str | None = "default",
    ):
        if isinstance(settings, int) and not isinstance(settings, bool) and num_workers is None:
            settings, num_workers = None, settings  # RayExecutor(4): the count, positionally
        if settings is not None and not isinstance(settings, RaySettings):
            raise TypeError(
                f"settings must come from RayExecutor.create_settings(...) (or be None), got "
                f"{type(settings).__name__}; ringtrain does not read Horovod's Settings objects"
            )
        self.settings = settings if settings is not None else RaySettings()
        # Only settings the caller made reach the workers (the defaults stay ringcore's).
        self._settings_env = settings.worker_env() if settings is not None else {}
        if not use_current_placement_group and placement_group == "default":
            placement_group = None  # Horovod's spelling of "always make a new group"
        self._elastic: ElasticRayExecutor | None = None
        if min_workers is not None or max_workers is not None:
            if min_workers is None:
                raise ValueError(
                    f"max_workers={max_workers!r} was given without min_workers; an elastic job "
                    "needs a positive min_workers (and no num_workers)"
                )
            if num_workers is not None or num_hosts is not None:
                raise ValueError(
                    f"pass either num_workers/num_hosts (a fixed group) or min_workers/max_workers "
                    f"(elastic), not both: got num_workers={num_workers!r}, num_hosts="
                    f"{num_hosts!r}, min_workers={min_workers!r}"
                )
            self._elastic = ElasticRayExecutor(
                self.settings,
                use_gpu=use_gpu,
                cpus_per_slot=cpus_per_worker,
                gpus_per_slot=gpus_per_worker,
                override_discovery=override_discovery,
                min_workers=min_workers,
                max_workers=max_workers,
                reset_limit=reset_limit,
                cooldown_range=cooldown_range,
                elastic_timeout=elastic_timeout,
            )
            num_workers = min_workers  # the fixed-group attributes below stay meaningful
        elif reset_limit is not None or cooldown_range is not None:
            raise ValueError(
                "reset_limit and cooldown_range apply to an elastic job; pass min_workers "
                "(and max_workers) with them, or drop them for a fixed num_workers"
            )
        if (num_workers is None) == (num_hosts is None):
            raise ValueError(
                f"pass exactly one of num_workers ({num_workers!r}) or num_hosts ({num_hosts!r})"
            )
        counts = (("num_workers", num_workers), ("num_hosts", num_hosts))
        for name, value in (*counts, ("num_workers_per_host", num_workers_per_host)):
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        _positive("cpus_per_worker", cpus_per_worker)
        _positive("gpus_per_worker", gpus_per_worker, allow_none=True)
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError(f"gpus_per_worker={gpus_per_worker!r} needs use_gpu=True")
        if placement_strategy not in const.PLACEMENT_STRATEGIES:
            raise ValueError(
                f"placement_strategy must be one of {const.PLACEMENT_STRATEGIES}, got {placement_strategy!r}"
            )
        self.num_hosts = num_hosts
        self.num_workers_per_host = int(num_workers_per_host) if num_hosts is not None else 1
        self.num_workers: int = num_workers or int(num_hosts or 0) * self.num_workers_per_host
        self.cpus_per_worker = cpus_per_worker
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_gpu = use_gpu
        self.resources_per_worker = dict(resources_per_worker or {})
        self.placement_strategy = "STRICT_SPREAD" if num_hosts is not None else placement_strategy
        self.placement_group_timeout_s = (
            placement_group_timeout_s
            if placement_group_timeout_s is not None
            else settings.placement_group_timeout_s
            if settings is not None
            else get_float(
                const.PLACEMENT_GROUP_TIMEOUT_ENV_VAR, const.DEFAULT_PLACEMENT_GROUP_TIMEOUT_S
            )
        )
        if not (
            placement_group in (None, "default") or isinstance(placement_group, PlacementGroup)
        ):
            raise ValueError(
                f"placement_group must be a ray PlacementGroup, 'default' (the caller's current "
                f"group, if any) or None (always a new group), got {placement_group!r}"
            )
        self.placement_group = placement_group
        self._pg: PlacementGroup | None = None
        self._owns_pg = False
        self._workers: list[Any] = []
        self._hosts: list[str] = []
        self._node_ids: list[str] = []

    # -- lifecycle -----------------------------------------------------------------

    def start(
        self,
        executable_cls: type | None = None,
        executable_args: tuple | list | None = None,
        executable_kwargs: dict | None = None,
        extra_env_vars: dict[str, str] | None = None,
    ) -> None:
        """Place and start the workers; ``execute(fn)`` later calls ``fn(executable_cls(...))``.

        Elastic (``min_workers=``): checks Ray only; the workers start in each ``run``.
        """
        if self._elastic is not None:
            if executable_cls is not None:
                raise NotImplementedError(
                    "an elastic RayExecutor (min_workers=...) starts new workers for each "
                    "run, so it holds no executable_cls objects; construct the object inside "
                    "the function you pass to run()"
                )
            self._elastic.start(extra_env_vars)
            return
        require_ray("start()")
        if self._workers:
            raise RingError("this RayExecutor is already started; call shutdown() first")
        check_cluster_gpus(self.gpus_per_worker, "RayExecutor")
        try:
            self._pg = self._place()
            self._workers, self._hosts, self._node_ids = self._create_workers(self._pg)
            self._setup_workers(executable_cls, executable_args, executable_kwargs, extra_env_vars)
        except BaseException:
            self.shutdown()
            raise
        log.debug(
            "RayExecutor started %d workers on %s", self.num_workers, sorted(set(self._hosts))
        )

    def shutdown(self) -> None:
        """Kill every worker actor and remove the placement group. Safe to call twice."""
        if self._elastic is not None:
            self._elastic.shutdown()
        workers, self._workers, self._hosts, self._node_ids = self._workers, [], [], []
        for worker in workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception as exc:  # already dead, or Ray shut down first
                log.debug("could not kill a worker: %s", exc)
        pg, self._pg = self._pg, None
        if pg is not None and self._owns_pg:
            try:
                remove_placement_group(pg)
            except Exception as exc:
                log.debug("could not remove the placement group: %s", exc)

    def __enter__(self) -> RayExecutor:
        if not self._workers:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- running -------------------------------------------------------------------

    def run(
        self,
        fn: Callable | str | os.PathLike,
        args: tuple | list | None = None,
        kwargs: dict | None = None,
        callbacks: list[Callable] | None = None,
    ) -> list:
        """``fn(*args, **kwargs)`` on every rank; the results ordered by rank.

        Every callable in ``callbacks`` is called on the driver with every value a rank
        logs with ``ray_runner.ray_logger.log(value)`` while ``fn`` runs (as Horovod's).

        ``fn`` may be the path of a Python file instead, ``args`` its command-line
        arguments (strings): every rank runs it as ``python PATH ARGS`` in a process of
        its own with torchrun's variables set, and its result is None; a non-zero exit
        raises :class:`ringcore.WorkerError` with the script's ``exit_code``.
        """
        hooks = check_callbacks(callbacks)
        if is_script(fn):
            fn, args, kwargs = ShippedScript.from_driver(fn, args, kwargs), None, None
        if self._elastic is not None:
            return self._elastic.run_fn(fn, tuple(args or ()), dict(kwargs or {}), callbacks)
        refs = self._submit("run", fn, tuple(args or ()), kwargs)
        return collect_logging(refs, list(self._workers), self._hosts, hooks)

    def run_remote(
        self, fn: Callable, args: tuple | list | None = None, kwargs: dict | None = None
    ) -> list:
        """As ``run`` but returns one ObjectRef per rank at once; ``ray.get`` raises an
        exception that is an instance of :class:`ringcore.WorkerError` when a rank failed."""
        self._fixed_only("run_remote", "its workers come and go, so there are no ObjectRefs")
        return self._submit("run_raising", fn, tuple(args or ()), kwargs)

    def execute(self, fn: Callable, callbacks: list[Callable] | None = None) -> list:
        """``fn(executable)`` on every rank (the object ``start(executable_cls=...)`` made);
        ``callbacks`` as in :meth:`run`."""
        hooks = check_callbacks(callbacks)
        self._fixed_only("execute", "it holds no executable_cls objects")
        refs = self._submit("execute", fn)
        return collect_logging(refs, list(self._workers), self._hosts, hooks)

    def execute_single(self, fn: Callable) -> Any:
        """``fn(executable)`` on rank 0 only."""
        self._fixed_only("execute_single", "it has no fixed rank 0 worker")
        return collect([self._started()[0].execute.remote(fn)], self._hosts)[0]

    @property
    def workers(self) -> list:
        """The worker actor handles, ordered by rank."""
        return list(self._workers)

    @property
    def hosts(self) -> list[str]:
        """The node IP of every rank, ordered by rank."""
        return list(self._hosts)

    @property
    def node_ids(self) -> list[str]:
        """The Ray node id of every rank, ordered by rank (local ranks count per node id)."""
        return list(self._node_ids)

    # -- internals -----------------------------------------------------------------

    def _fixed_only(self, method: str, why: str) -> None:
        if self._elastic is not None:
            raise NotImplementedError(
                f"{method}() is not available on an elastic RayExecutor (min_workers=...): "
                f"{why}. Use run(fn, args=..., kwargs=...)"
            )

    def _started(self) -> list:
        if not self._workers:
            raise RingError("this RayExecutor is not started; call start() first")
        return self._workers

    def _submit(self, method: str, *args: Any) -> list:
        self._fresh_master_port()
        return [getattr(w, method).remote(*args) for w in self._started()]

    def _fresh_master_port(self) -> None:
        """Each call's ``MASTER_PORT``: a port free on rank 0's node now. The user's
        process group of the last call may still hold the last one (a group's store
        outlives ``destroy_process_group`` while Lightning or FSDP keep it), and a script
        of this call runs in a process of its own that must host its store anew."""
        workers = self._started()
        port = collect([workers[0].master_port.remote()], self._hosts)[0]
        ray.get([w.update_env.remote({"MASTER_PORT": str(port)}) for w in workers])

    def _setup_workers(
        self,
        executable_cls: type | None,
        executable_args: tuple | list | None,
        executable_kwargs: dict | None,
        extra_env_vars: dict[str, str] | None,
    ) -> None:
        """Open the store on rank 0, then hand every rank its topology and environment."""
        workers, hosts = self._workers, self._hosts
        port, master_port = self._start_store(workers)
        store_addr = _LOOPBACK if len(set(hosts)) == 1 else hosts[0]
        gpu_env = self._gpu_env() if self.gpus_per_worker else [{} for _ in workers]
        setups = []
        secret = new_secret()  # one per job: authenticates the engine's control connections
        run_id = uuid.uuid4().hex  # torchrun's TORCHELASTIC_RUN_ID
        for rank, worker in enumerate(workers):
            # Local ranks count per Ray node (two nodes may share an IP); the ring
            # itself talks to each rank's IP.
            topology = topology_from_hosts(self._node_ids, rank)
            env = {
                **worker_env(topology, store_addr, port, secret=secret),
                **torchrun_env(topology, store_addr, master_port, run_id),
                HOSTNAME_ENV_VAR: hosts[rank],
                **self._settings_env,
                **gpu_env[rank],
                **(extra_env_vars or {}),
            }
            args = (topology, env, executable_cls, tuple(executable_args or ()), executable_kwargs)
            setups.append(worker.setup.remote(*args))
        collect(setups, self._hosts)

    def _gpu_env(self) -> list[dict[str, str]]:
        """Every worker sees all GPUs Ray gave the workers of its node (as Horovod's
        RayExecutor), so that ``local_rank`` picks the device and NCCL sees its peers."""
        gpu_ids = ray.get([w.gpu_ids.remote() for w in self._workers])
        visible = cuda_visible_devices(self._node_ids, gpu_ids)
        return [{"CUDA_VISIBLE_DEVICES": v, const.GPU_ADDRESSES_ENV_VAR: v} for v in visible]

    def _start_store(self, workers: list) -> tuple[int, int]:
        """Rank 0 hosts the store while the other ranks load the ring's transport meanwhile,
        then picks ``MASTER_PORT`` on its node: the store's port and that one."""
        port = 0  # a single rank needs no TCP store (ringcore uses an in-process one)
        if len(workers) > 1:
            refs = [workers[0].start_store.remote(len(workers))]
            refs += [w.prepare_ring.remote() for w in workers[1:]]
            port = int(collect(refs, self._hosts)[0])
        return port, int(collect([workers[0].master_port.remote()], self._hosts)[0])

    def _bundles(self) -> list[dict[str, float]]:
        per_worker = self._bundles_per_worker()
        if self.num_hosts is None:
            return [dict(per_worker) for _ in range(self.num_workers)]
        return [
            {k: v * self.num_workers_per_host for k, v in per_worker.items()}
            for _ in range(self.num_hosts)
        ]

    def _place(self) -> PlacementGroup:
        """The workers' placement group: the given or current one, else a new one."""
        given = self.placement_group
        if given == "default":
            given = get_current_placement_group()
        if isinstance(given, PlacementGroup):
            self._owns_pg = False
            return given
        bundles = self._bundles()
        pg = placement_group(bundles, strategy=self.placement_strategy)
        if pg.wait(timeout_seconds=self.placement_group_timeout_s):
            self._owns_pg = True
            return pg
        remove_placement_group(pg)
        raise PlacementGroupTimeoutError(self._placement_message(bundles))

    def _placement_message(self, bundles: list[dict[str, float]]) -> str:
        keys = sorted({k for b in bundles for k in b})
        total, free = ray.cluster_resources(), ray.available_resources()

        def pick(resources: dict[str, float]) -> dict[str, float]:
            return {k: resources.get(k, 0.0) for k in keys}

        return (
            f"Could not place {self.num_workers} workers within {self.placement_group_timeout_s:g} s: "
            f"the placement group needs {len(bundles)} bundle(s) of {bundles[0]} "
            f"(strategy {self.placement_strategy}), but the cluster has {pick(total)} in total "
            f"and {pick(free)} free. Lower num_workers or the resources per worker, add nodes, or "
            f"raise placement_group_timeout_s (${const.PLACEMENT_GROUP_TIMEOUT_ENV_VAR})."
        )

    def _create_workers(self, pg: PlacementGroup) -> tuple[list, list[str], list[str]]:
        # Ray's stubs miss the concurrency_groups overload.
        actor_cls = ray.remote(concurrency_groups={CONTROL_GROUP: 1})(self.worker_cls)  # type: ignore[call-overload]
        workers = []
        for i in range(self.num_workers):
            # In a group we did not make (a Tune trial's), any bundle with room will do.
            bundle = i // self.num_workers_per_host if self._owns_pg else -1
            strategy = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=bundle)
            options: dict[str, Any] = {
                "num_cpus": self.cpus_per_worker,
                "scheduling_strategy": strategy,
            }
            if self.gpus_per_worker:
                options["num_gpus"] = self.gpus_per_worker
            if self.resources_per_worker:
                options["resources"] = dict(self.resources_per_worker)
            workers.append(actor_cls.options(**options).remote())
        self._workers = workers  # so that shutdown() kills them if the next call fails
        refs = [w.node.remote() for w in workers]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self.placement_group_timeout_s)
        if len(ready) < len(refs):
            raise PlacementGroupTimeoutError(
                f"only {len(ready)} of {self.num_workers} workers started within "
                f"{self.placement_group_timeout_s:g} s in the existing placement group "
                f"(bundles {pg.bundle_specs}); each worker needs {self._bundles_per_worker()}. "
                "Make the group's bundles hold the workers, or pass placement_group=None so "
                "that RayExecutor makes its own group."
            )
        nodes = ray.get(refs)
        ips, node_ids = [n[0] for n in nodes], [n[1] for n in nodes]
        # Ranks of one node contiguous, nodes in order of first appearance.
        ranked = host_major_order(node_ids)
        return (
            [workers[i] for i in ranked],
            [ips[i] for i in ranked],
            [node_ids[i] for i in ranked],
        )

    def _bundles_per_worker(self) -> dict[str, float]:
        per_worker: dict[str, float] = {"CPU": self.cpus_per_worker, **self.resources_per_worker}
        if self.gpus_per_worker:
            per_worker["GPU"] = self.gpus_per_worker
        return per_worker
