"""ray_runner: ringtrain on Ray — ``RayExecutor`` (actors that form a ring) and ``RingTrainer``.

Ray must be running in the driver first: ``ray.init()`` for a local instance or
``ray.init(address="auto")`` for a cluster; ray_runner never starts Ray itself.
Worker actors share the driver's Python environment.
"""

from ._checkpoint import Checkpoint
from ._config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ._errors import PlacementGroupTimeoutError, TrainingFailedError
from ._executor import RayExecutor
from ._session import TrainContext, get_checkpoint, get_context, get_dataset_shard, report
from ._trainer import Result, RingTrainer

__all__ = [
    "Checkpoint",
    "CheckpointConfig",
    "FailureConfig",
    "PlacementGroupTimeoutError",
    "RayExecutor",
    "Result",
    "RingTrainer",
    "RunConfig",
    "ScalingConfig",
    "TrainContext",
    "TrainingFailedError",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "report",
]
