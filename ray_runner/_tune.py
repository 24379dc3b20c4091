"""``RingTrainer.as_trainable()``: a RingTrainer as a Ray Tune function trainable.

::

    tuner = tune.Tuner(
        trainer.as_trainable(),
        param_space={"lr": tune.grid_search([0.01, 0.1])},
        tune_config=tune.TuneConfig(metric="loss", mode="min"),
    )
    results = tuner.fit()

Each trial reserves one placement group: an empty head bundle for the trial itself
and one bundle per worker; the trial's ``RayExecutor`` places its workers inside that
group (it uses the caller's current placement group). The trial's config updates
``train_loop_config``; each report of rank 0 is passed on with ``tune.report``.
Elastic ``num_workers=(min, max)`` is not available inside Tune (a trial's group is fixed).
"""

from __future__ import annotations

import copy
import dataclasses
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._trainer import RingTrainer

__all__ = ["trainable_of"]


def trainable_of(trainer: RingTrainer) -> Any:
    from ray import tune

    sc = trainer.scaling_config
    if sc.elastic:
        raise ValueError(
            f"as_trainable() needs a fixed number of workers, got num_workers={sc.num_workers!r}; "
            "a Tune trial's placement group cannot grow or shrink"
        )
    bundle: dict[str, float] = {"CPU": sc.cpus_per_worker, **sc.extra_resources}
    if sc.gpus_per_worker:
        bundle["GPU"] = sc.gpus_per_worker
    num_workers = sc.max_workers

    def ring_trainable(config: dict) -> None:
        context = tune.get_context()
        run_config = dataclasses.replace(
            trainer.run_config,
            name=f"{trainer.run_config.name or 'RingTrainer'}_{context.get_trial_id()}",
        )
        trial = copy.copy(trainer)  # this trial's config and run name
        if config and not trainer._pass_config:
            raise ValueError(
                f"the Tune trial passes config {config!r} but train_loop_per_worker takes no "
                "argument; define it as train_loop_per_worker(config)"
            )
        trial.train_loop_config = {**(trainer.train_loop_config or {}), **config}
        trial.run_config = run_config
        trial.fit(_on_report=_to_tune)

    ring_trainable.__name__ = (
        f"RingTrainer_{getattr(trainer.train_loop_per_worker, '__name__', 'loop')}"
    )
    resources = tune.PlacementGroupFactory([{}] + [dict(bundle) for _ in range(num_workers)])
    return tune.with_resources(ring_trainable, resources)


def _to_tune(item: dict) -> None:
    from ray import tune

    checkpoint = item.get("checkpoint")
    if checkpoint is None:
        tune.report(dict(item["metrics"]))
    else:
        kept = (
            tune.Checkpoint(checkpoint.path, filesystem=checkpoint.filesystem)
            if checkpoint.filesystem is not None
            else tune.Checkpoint.from_directory(checkpoint.path)
        )
        tune.report(dict(item["metrics"]), checkpoint=kept)
