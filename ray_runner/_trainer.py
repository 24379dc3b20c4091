"""``RingTrainer``: fit a training loop on a group of Ray workers, with checkpoints and restarts.

The control loop is small: start a worker group (a :class:`RayExecutor`), run the
loop on every rank while printing rank 0's reports as they arrive, and when a rank
fails, shut the whole group down and start a new one from the latest checkpoint,
up to ``FailureConfig.max_failures`` times; then :class:`TrainingFailedError`.
Ray must be initialized (``ray.init(...)``) before ``fit()``; a Ray Client driver
(``ray.init("ray://head:10001")``) works too, for fixed-size groups: the run folder must
then be on a filesystem that the driver and the cluster share (``fit()`` checks that
the cluster sees the folder the driver made), and an elastic group is refused, since
its driver hosts the store the workers connect to.
"""

from __future__ import annotations

import copy
import datetime
import inspect
import logging
import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import ray

from ringcore import RingError, WorkerError
from ringcore.launch import ShippedScript, get_float, is_script

from . import _constants as const
from ._checkpoint import Checkpoint, CheckpointStore
from ._cluster import check_cluster_gpus, check_visible_on_cluster, client_connected, require_ray
from ._config import RunConfig, ScalingConfig
from ._elastic_group import ElasticGroup
from ._envelopes import collect, other_errors
from ._errors import TrainingFailedError
from ._executor import RayExecutor
from ._progress import progress_callback
from ._results import Reports
from ._session import SessionSetup
from ._storage import check_writable
from ._storage import resolve as resolve_storage
from ._tbx_callback import bind_storage
from ._tune import trainable_of

log = logging.getLogger("ringtrain.ray_runner")

__all__ = ["Result", "RingTrainer"]


@dataclass
class Result:
    """What ``fit()`` returns, as Ray Train's ``Result``.

    ``metrics``: rank 0's last report; ``checkpoint``: the latest checkpoint;
    ``best_checkpoints``: ``(checkpoint, metrics)`` of every checkpoint kept, best first by
    ``checkpoint_score_attribute`` (newest first without one); ``path``: the run folder
    inside ``filesystem`` (a ``pyarrow.fs.FileSystem``); ``metrics_dataframe``: every report.
    """

    metrics: dict | None
    checkpoint: Checkpoint | None
    path: str
    error: BaseException | None = None
    metrics_history: list[dict] = field(default_factory=list, repr=False)
    best_checkpoints: list[tuple[Checkpoint, dict]] = field(default_factory=list, repr=False)
    filesystem: Any = field(default=None, repr=False)

    @property
    def metrics_dataframe(self) -> Any:
        """A pandas DataFrame with one row per report of rank 0, in order."""
        import pandas as pd

        return pd.DataFrame(self.metrics_history)


def _takes_config(fn: Callable) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return True
    return len(params) > 0


class RingTrainer:
    """Data-parallel training: ``train_loop_per_worker`` runs on every worker, as Ray Train's.

    Inside the loop ``ringcore.init()`` (or ``hvd.init()``) forms the ring unchanged, and
    so does ``torch.distributed.init_process_group()`` (every worker has torchrun's
    variables); ``ray_runner.report(metrics, checkpoint=...)``, ``ray_runner.get_checkpoint()``
    and ``ray_runner.get_context()`` talk to the run. The loop takes ``train_loop_config``
    as its one argument, or no argument. Checkpoints land under
    ``<RunConfig.storage_path>/<RunConfig.name>/``, which every worker must be able to write.

    ``train_loop_per_worker`` may be the path of a Python file instead, with its
    command-line arguments in ``script_args``: every worker runs it as ``python PATH
    ARGS`` (``ringcore.launch.ShippedScript``) on a fixed-size group. A script runs in a process of
    its own, so it writes its own metrics and checkpoints (``report`` is for functions);
    a non-zero exit is a failed worker, restarted by ``FailureConfig`` as any other.
    """

    executor_cls: type = RayExecutor  # seam: a test may inject a different worker group

    def __init__(
        self,
        train_loop_per_worker: Callable | str | os.PathLike,
        *,
        script_args: list[str] | None = None,
        train_loop_config: dict | None = None,
        scaling_config: ScalingConfig | None = None,
        run_config: RunConfig | None = None,
        datasets: dict | None = None,
        resume_from_checkpoint: Checkpoint | None = None,
    ):
        self._loop = _loop_of(train_loop_per_worker, script_args, train_loop_config)
        if train_loop_config is not None and not isinstance(train_loop_config, dict):
            raise TypeError(
                f"train_loop_config must be a dict or None, got {type(train_loop_config).__name__}"
            )
        self._pass_config = not isinstance(self._loop, ShippedScript) and _takes_config(self._loop)
        if train_loop_config is not None and not self._pass_config:
            raise ValueError(
                "train_loop_config was given but train_loop_per_worker takes no argument; "
                "define it as train_loop_per_worker(config)"
            )
        self.datasets = _check_datasets(datasets)
        if resume_from_checkpoint is not None and not isinstance(
            resume_from_checkpoint, Checkpoint
        ):
            raise TypeError(
                f"resume_from_checkpoint must be a ray_runner.Checkpoint, got "
                f"{type(resume_from_checkpoint).__name__}; e.g. result.checkpoint of an earlier fit"
            )
        self.resume_from_checkpoint = resume_from_checkpoint
        self.train_loop_per_worker = train_loop_per_worker
        self.train_loop_config = train_loop_config
        self.scaling_config = scaling_config if scaling_config is not None else ScalingConfig()
        self.run_config = run_config if run_config is not None else RunConfig()
        for name, value, cls in (
            ("scaling_config", self.scaling_config, ScalingConfig),
            ("run_config", self.run_config, RunConfig),
        ):
            if not isinstance(value, cls):
                raise TypeError(f"{name} must be a {cls.__name__}, got {type(value).__name__}")
        if isinstance(self._loop, ShippedScript) and self.scaling_config.elastic:
            raise ValueError(
                f"the script {self._loop.path!r} cannot run on an elastic group (num_workers="
                f"{self.scaling_config.num_workers!r}): its own process cannot re-form with "
                "the ring's generations. Pass an integer num_workers"
            )
        if self.datasets and self.scaling_config.elastic:
            raise ValueError(
                f"datasets= cannot be split over an elastic group (num_workers="
                f"{self.scaling_config.num_workers!r}); pass an integer num_workers, or read "
                "Parquet inside the loop with ringcore.data and an ElasticSampler"
            )

    def as_trainable(self) -> Any:
        """This trainer as a Ray Tune trainable: ``Tuner(trainer.as_trainable(), param_space=...)``.

        Each trial runs ``fit()`` with ``train_loop_config`` updated by the trial's config,
        its workers inside the trial's placement group; rank 0's reports reach Tune as
        ``tune.report`` (with the checkpoint when one was reported).
        """
        loop_name = getattr(self._loop, "__name__", None) or getattr(self._loop, "name", "loop")
        return trainable_of(self.scaling_config, f"RingTrainer_{loop_name}", self._fit_trial)

    def _fit_trial(self, config: dict, trial_id: str, on_report: Callable[[dict], None]) -> None:
        """One Tune trial: ``fit`` with ``train_loop_config`` updated by the trial's
        ``config``, under a run name of its own; ``on_report`` gets rank 0's reports."""
        if config and not self._pass_config:
            what = (
                "a script, which takes command-line arguments (script_args) only"
                if isinstance(self._loop, ShippedScript)
                else "a function of no argument; define it as train_loop_per_worker(config)"
            )
            raise ValueError(
                f"the Tune trial passes config {config!r} but train_loop_per_worker is {what}"
            )
        trial = copy.copy(self)
        trial.train_loop_config = {**(self.train_loop_config or {}), **config}
        name = f"{self.run_config.name or 'RingTrainer'}_{trial_id}"
        trial.run_config = replace(self.run_config, name=name)
        trial.fit(_on_report=on_report)

    def fit(self, _on_report: Callable[[dict], None] | None = None) -> Result:
        """Train; return the :class:`Result` or raise :class:`TrainingFailedError`."""
        require_ray("RingTrainer.fit()")
        check_cluster_gpus(self.scaling_config.gpus_per_worker, "RingTrainer (ScalingConfig)")
        name = (
            self.run_config.name
            or f"RingTrainer_{datetime.datetime.now():%Y-%m-%d_%H-%M-%S}_{uuid.uuid4().hex[:6]}"
        )
        client = client_connected()
        if client and self.scaling_config.elastic:
            raise RingError(
                f"an elastic RingTrainer (ScalingConfig(num_workers="
                f"{self.scaling_config.num_workers!r})) cannot run from a Ray Client driver "
                "(ray.init('ray://...')): its driver hosts the store that the workers connect "
                "to, and the cluster cannot reach a Ray Client driver. Run the driver on the "
                "cluster instead (ray job submit -- python train.py, or ray.init(address='auto') "
                "on a cluster node), or pass an integer num_workers"
            )
        rc = self.run_config
        storage = resolve_storage(rc.storage_path, rc.storage_filesystem)
        run_dir = storage.join(name)
        check_writable(storage, run_dir)
        if client and storage.local:
            check_visible_on_cluster(run_dir)
        cc = rc.checkpoint_config
        store = CheckpointStore(
            run_dir,
            cc.num_to_keep,
            storage.filesystem,
            cc.checkpoint_score_attribute,
            cc.checkpoint_score_order,
        )
        display = progress_callback(rc, "RingTrainer")  # None when off
        callbacks = [*(rc.callbacks or ()), *([display] if display else [])]
        bind_storage(callbacks, storage.filesystem)
        reports = Reports(store, rc.verbose if display is None else 0, callbacks, _on_report)
        for callback in callbacks:
            callback.on_start(name=name, path=run_dir, config=self.train_loop_config)
        try:
            self._attempts(name, store, reports)
        except BaseException as exc:
            for callback in callbacks:
                callback.on_error(exc)
            raise
        kept = store.committed()
        result = Result(
            metrics=reports.history[-1] if reports.history else None,
            checkpoint=kept[-1].checkpoint if kept else None,
            path=run_dir,
            metrics_history=reports.history,
            best_checkpoints=[(c.checkpoint, c.metrics) for c in store.ranked(kept)],
            filesystem=storage.filesystem,
        )
        for callback in callbacks:
            callback.on_end(result)
        return result

    def _attempts(self, name: str, store: CheckpointStore, reports: Reports) -> None:
        """Worker groups until one succeeds, or raise once restarts run out."""
        max_failures = self.run_config.failure_config.max_failures
        failures = 0
        while True:
            store.remove_uncommitted()  # a killed attempt's partial uploads
            reports.new_attempt()
            errors = self._attempt(name, store, reports)
            reports.finish(succeeded=not errors)
            if not errors:
                return
            failures += 1
            error = errors[0]
            if max_failures != -1 and failures > max_failures:
                ordered = sorted(errors, key=lambda e: e.rank)
                raise TrainingFailedError(error, failures, max_failures, ordered) from error
            for callback in self.run_config.callbacks or ():
                callback.on_restart(error=error, failures=failures)
            self._announce_restart(error, failures, store.latest())

    def _announce_restart(
        self, error: WorkerError, failures: int, latest: Checkpoint | None
    ) -> None:
        limit = self.run_config.failure_config.max_failures
        origin = latest.path if latest is not None else "scratch"
        level = logging.INFO if self.run_config.verbose else logging.WARNING
        log.log(
            level,
            "rank %d failed (%s); restart %d of %s from %s",
            error.rank,
            error.error_type,
            failures,
            "unlimited" if limit == -1 else limit,
            origin,
        )
        if self.run_config.verbose:
            print(
                f"[RingTrainer] rank {error.rank} failed ({error.error_type}: {error.message}); "
                f"restarting the workers from {origin}",
                flush=True,
            )

    def _executor(self) -> RayExecutor:
        sc = self.scaling_config
        assert isinstance(sc.num_workers, int)
        return self.executor_cls(
            num_workers=sc.num_workers,
            cpus_per_worker=sc.cpus_per_worker,
            use_gpu=sc.use_gpu,
            gpus_per_worker=sc.gpus_per_worker,
            resources_per_worker=sc.extra_resources,
            placement_strategy=sc.placement_strategy,
        )

    def _setup(self, name: str, store: CheckpointStore) -> SessionSetup:
        import pyarrow.fs as pafs

        local = isinstance(store.filesystem, pafs.LocalFileSystem)
        return SessionSetup(
            experiment_name=name,
            run_dir=store.run_dir,
            num_to_keep=store.num_to_keep,
            restore=store.latest() or self.resume_from_checkpoint,
            config=self.train_loop_config,
            pass_config=self._pass_config,
            elastic=self.scaling_config.elastic,
            filesystem=None if local else store.filesystem,
            next_index=store.next_index(),
            attempt=uuid.uuid4().hex[:12],
            score_attribute=store.score_attribute,
        )

    def _attempt(self, name: str, store: CheckpointStore, progress: Reports) -> list[WorkerError]:
        """One worker group from start to end; the failed ranks' errors (first failure
        first), or [] on success."""
        setup = self._setup(name, store)
        poll_s = get_float(const.REPORT_POLL_INTERVAL_ENV_VAR, const.DEFAULT_REPORT_POLL_INTERVAL_S)
        if self.scaling_config.elastic:
            return ElasticGroup(self.scaling_config).run(self._loop, setup, progress.add, poll_s)
        executor = self._executor()
        try:
            executor.start()
            shards = _split(self.datasets, executor.num_workers)
            drain = _reports_of(executor.workers[0], progress)
            refs = [
                worker.run_loop.remote(self._loop, replace(setup, datasets=shards[rank]))
                for rank, worker in enumerate(executor.workers)
            ]
            try:
                collect(refs, executor.hosts, drain, poll_s)
            except WorkerError as first:
                return [first, *other_errors(refs, executor.hosts, first.rank)]
            finally:
                drain()  # what rank 0 reported just before a failure counts too
            return []
        except WorkerError as exc:
            return [exc]
        finally:
            executor.shutdown()


def _loop_of(what: Any, script_args: Any, config: dict | None) -> Callable:
    """What every worker runs: the user's function, or the :class:`~ringcore.launch.ShippedScript` at a path."""
    if is_script(what):
        if config is not None:
            raise ValueError(
                f"train_loop_config cannot reach the script {os.fspath(what)!r}: a script "
                "reads its command line; pass script_args=['--name', 'value', ...]"
            )
        return ShippedScript.from_driver(what, script_args)
    if script_args is not None:
        raise ValueError(
            "script_args are the command line of a script; train_loop_per_worker is a "
            "function: pass train_loop_config, or the path of a Python file"
        )
    if not callable(what):
        raise TypeError(
            f"train_loop_per_worker must be callable or the path of a Python file, got "
            f"{type(what).__name__}"
        )
    return what


def _check_datasets(datasets: dict | None) -> dict:
    if not datasets:
        return {}
    if not isinstance(datasets, dict):
        raise TypeError(f"datasets must be a dict of name -> ray.data.Dataset, got {datasets!r}")
    import ray.data

    for key, ds in datasets.items():
        if not isinstance(key, str) or not isinstance(ds, ray.data.Dataset):
            raise TypeError(
                f"datasets[{key!r}] is a {type(ds).__name__}; RingTrainer(datasets=...) takes "
                "ray.data.Dataset values under str names (make one with ray.data.read_parquet, "
                "ray.data.from_pandas, ...)"
            )
    return dict(datasets)


def _split(datasets: dict, n: int) -> list[dict | None]:
    """Per rank, its streaming shard of every dataset (``equal=True``: the same row count)."""
    if not datasets:
        return [None] * n
    splits = {name: ds.streaming_split(n, equal=True) for name, ds in datasets.items()}
    return [{name: parts[rank] for name, parts in splits.items()} for rank in range(n)]


def _reports_of(rank0: Any, progress: Reports) -> Callable[[], None]:
    """A poll that moves rank 0's queued reports to ``progress``.

    A dead rank 0 is not the poll's to report: its run call fails and says so.
    """

    def drain() -> None:
        try:
            progress.add(ray.get(rank0.drain_reports.remote()))
        except ray.exceptions.RayError as exc:
            log.debug("could not collect rank 0's reports: %s", exc)

    return drain
