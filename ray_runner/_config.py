"""RingTrainer's configs: frozen dataclasses, validated on construction.

Names and meanings follow Ray Train's ``ScalingConfig``, ``RunConfig``,
``FailureConfig`` and ``CheckpointConfig``, so a Ray Train script ports with its
imports changed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from . import _constants as const

__all__ = ["CheckpointConfig", "FailureConfig", "RunConfig", "ScalingConfig"]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class ScalingConfig:
    """How many workers and what each one holds.

    ``resources_per_worker`` defaults to ``{"CPU": 1}`` (plus ``{"GPU": 1}`` with
    ``use_gpu=True``); other keys are Ray custom resources. ``num_workers=(min, max)``
    scales elastically: training starts with as many workers as fit (at least ``min``),
    goes on when workers are lost (down to ``min``) and grows back to ``max`` when
    resources return; the loop keeps its state with ``ringcore.torch.elastic``.
    """

    num_workers: int | tuple[int, int] = 2
    use_gpu: bool = False
    resources_per_worker: dict[str, float] | None = None
    placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        if isinstance(self.num_workers, tuple):
            low, high = (*self.num_workers, None, None)[:2]
            if (
                len(self.num_workers) != 2
                or not (_is_int(low) and _is_int(high))
                or not 1 <= low <= high
            ):
                raise ValueError(
                    f"ScalingConfig.num_workers=(min, max) needs integers 1 <= min <= max, "
                    f"got {self.num_workers!r}"
                )
        elif not _is_int(self.num_workers) or self.num_workers < 1:
            raise ValueError(
                f"ScalingConfig.num_workers must be an integer >= 1, got {self.num_workers!r}"
            )
        if not isinstance(self.use_gpu, bool):
            raise ValueError(f"ScalingConfig.use_gpu must be True or False, got {self.use_gpu!r}")
        if self.placement_strategy not in const.PLACEMENT_STRATEGIES:
            raise ValueError(
                f"ScalingConfig.placement_strategy must be one of {const.PLACEMENT_STRATEGIES}, "
                f"got {self.placement_strategy!r}"
            )
        resources = self.resources_per_worker
        if resources is None:
            return
        if not isinstance(resources, dict):
            raise ValueError(
                f"ScalingConfig.resources_per_worker must be a dict, got {type(resources).__name__}"
            )
        for key, amount in resources.items():
            if (
                not isinstance(key, str)
                or isinstance(amount, bool)
                or not isinstance(amount, (int, float))
                or amount < 0
            ):
                raise ValueError(
                    f"ScalingConfig.resources_per_worker[{key!r}]={amount!r}: keys must be resource "
                    "names and amounts numbers >= 0"
                )
        if resources.get("GPU", 0) > 0 and not self.use_gpu:
            raise ValueError(
                f"ScalingConfig.resources_per_worker asks for GPU={resources['GPU']} but use_gpu=False; "
                "set use_gpu=True"
            )
        if resources.get("CPU", 1) <= 0:
            raise ValueError(
                f"ScalingConfig.resources_per_worker['CPU'] must be > 0, got {resources['CPU']!r}"
            )

    @property
    def elastic(self) -> bool:
        return isinstance(self.num_workers, tuple)

    @property
    def min_workers(self) -> int:
        return self.num_workers[0] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def max_workers(self) -> int:
        return self.num_workers[1] if isinstance(self.num_workers, tuple) else self.num_workers

    @property
    def cpus_per_worker(self) -> float:
        return (self.resources_per_worker or {}).get("CPU", 1)

    @property
    def gpus_per_worker(self) -> float | None:
        if not self.use_gpu:
            return None
        return (self.resources_per_worker or {}).get("GPU", 1) or None

    @property
    def extra_resources(self) -> dict[str, float]:
        """Custom resources per worker: everything but CPU and GPU."""
        return {
            k: v for k, v in (self.resources_per_worker or {}).items() if k not in ("CPU", "GPU")
        }


@dataclass(frozen=True)
class FailureConfig:
    """``max_failures``: how often the whole group restarts after a worker fails (-1: forever)."""

    max_failures: int = 0

    def __post_init__(self) -> None:
        if not _is_int(self.max_failures) or self.max_failures < -1:
            raise ValueError(
                f"FailureConfig.max_failures must be an integer >= -1 (-1 retries forever), got {self.max_failures!r}"
            )


@dataclass(frozen=True)
class CheckpointConfig:
    """Which reported checkpoints stay in storage.

    ``num_to_keep`` (None keeps all): how many stay; the others are deleted oldest first,
    or worst first when ``checkpoint_score_attribute`` names a numeric metric reported
    with every checkpoint (``checkpoint_score_order="max"`` keeps the highest, ``"min"``
    the lowest). The latest checkpoint is always kept as well, since a restart resumes
    from it.
    """

    num_to_keep: int | None = None
    checkpoint_score_attribute: str | None = None
    checkpoint_score_order: str = "max"

    def __post_init__(self) -> None:
        if self.num_to_keep is not None and (not _is_int(self.num_to_keep) or self.num_to_keep < 1):
            raise ValueError(
                f"CheckpointConfig.num_to_keep must be None (keep all) or an integer >= 1, got {self.num_to_keep!r}"
            )
        if self.checkpoint_score_attribute is not None and (
            not isinstance(self.checkpoint_score_attribute, str)
            or not self.checkpoint_score_attribute
        ):
            raise ValueError(
                "CheckpointConfig.checkpoint_score_attribute must be a metric name (str) or None, "
                f"got {self.checkpoint_score_attribute!r}"
            )
        if self.checkpoint_score_order not in ("max", "min"):
            raise ValueError(
                f"CheckpointConfig.checkpoint_score_order must be 'max' or 'min', got "
                f"{self.checkpoint_score_order!r}"
            )


@dataclass(frozen=True)
class RunConfig:
    """Where a run lives (``<storage_path>/<name>/``) and how it handles failures and checkpoints.

    ``storage_path`` defaults to ``$RING_STORAGE_PATH`` or ``~/ringtrain_results``: a
    local folder every worker can write (a shared filesystem on a multi-node cluster) or
    a URI such as ``s3://bucket/prefix`` (opened with pyarrow.fs, else fsspec).
    ``storage_filesystem`` (a ``pyarrow.fs.FileSystem`` or fsspec filesystem) overrides
    the URI's own filesystem. ``callbacks`` are :class:`ray_runner.Callback` objects
    called on the driver.
    ``name`` defaults to ``RingTrainer_<time>_<id>``; a ``name`` that already holds
    checkpoints resumes from its latest one. ``verbose=1`` prints each report of rank 0
    on the driver as it arrives; ``verbose=0`` is silent. ``progress`` (with
    ``verbose=1``): a live progress bar of rank 0's reports (step, loss, steps/s);
    ``progress=False`` or ``RING_PROGRESS=0`` turns it off.
    """

    name: str | None = None
    storage_path: str | os.PathLike | None = None
    failure_config: FailureConfig = field(default_factory=FailureConfig)
    checkpoint_config: CheckpointConfig = field(default_factory=CheckpointConfig)
    verbose: int = 1
    storage_filesystem: Any = None
    callbacks: list | None = None
    progress: bool = True

    def __post_init__(self) -> None:
        if self.name is not None and (
            not isinstance(self.name, str)
            or not self.name.strip()
            or os.sep in self.name
            or self.name in (".", "..")
        ):
            raise ValueError(
                f"RunConfig.name must be a non-empty folder name without {os.sep!r}, got {self.name!r}"
            )
        if self.storage_path is not None and not isinstance(self.storage_path, (str, os.PathLike)):
            raise ValueError(
                f"RunConfig.storage_path must be a path, got {type(self.storage_path).__name__}"
            )
        if not isinstance(self.failure_config, FailureConfig):
            raise ValueError(
                f"RunConfig.failure_config must be a FailureConfig, got {self.failure_config!r}"
            )
        if not isinstance(self.checkpoint_config, CheckpointConfig):
            raise ValueError(
                f"RunConfig.checkpoint_config must be a CheckpointConfig, got {self.checkpoint_config!r}"
            )
        from ._callbacks import Callback

        for callback in self.callbacks or ():
            if not isinstance(callback, Callback):
                raise ValueError(
                    f"RunConfig.callbacks holds {callback!r}, a {type(callback).__name__}; each "
                    "callback must be a ray_runner.Callback (subclass it and override on_report, "
                    "on_end, ...)"
                )
        if self.verbose not in (0, 1):
            raise ValueError(f"RunConfig.verbose must be 0 or 1, got {self.verbose!r}")
        if not isinstance(self.progress, bool):
            raise ValueError(f"RunConfig.progress must be True or False, got {self.progress!r}")
