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

from collections.abc import Callable
from typing import Any

from ._config import ScalingConfig

__all__ = ["trainable_of"]

#: what a trial runs: ``fit_trial(config, trial_id, on_report)``, ``on_report`` taking
#: each of rank 0's reports (``RingTrainer._fit_trial``)
FitTrial = Callable[[dict, str, Callable[[dict], None]], Any]


def trainable_of(scaling: ScalingConfig, name: str, fit_trial: FitTrial) -> Any:
    """``fit_trial`` as a Tune function trainable called ``name``, each trial in a
    placement group of an empty head bundle and one bundle per worker of ``scaling``;
    rank 0's reports reach Tune through ``tune.report``."""
    from ray import tune

    if scaling.elastic:
        raise ValueError(
            f"as_trainable() needs a fixed number of workers, got num_workers="
            f"{scaling.num_workers!r}; a Tune trial's placement group cannot grow or shrink"
        )
    bundle: dict[str, float] = {"CPU": scaling.cpus_per_worker, **scaling.extra_resources}
    if scaling.gpus_per_worker:
        bundle["GPU"] = scaling.gpus_per_worker

    def ring_trainable(config: dict) -> None:
        fit_trial(config, tune.get_context().get_trial_id(), _to_tune)

    ring_trainable.__name__ = name
    bundles: list[dict[str, float]] = [{}] + [dict(bundle) for _ in range(scaling.max_workers)]
    return tune.with_resources(ring_trainable, tune.PlacementGroupFactory(bundles))


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
