"""ray_runner: ringtrain on Ray — ``RayExecutor`` (actors that form a ring) and ``RingTrainer``.

Ray must be running in the driver first: ``ray.init()`` for a local instance or
``ray.init(address="auto")`` for a cluster; ray_runner never starts Ray itself.
Worker actors share the driver's Python environment. Horovod's ``horovod.ray`` shapes
work too: ``RayExecutor.create_settings(...)``, ``RayExecutor(settings, num_workers=...)``,
``run(fn, callbacks=[...])`` with ``ray_logger.log(value)`` on the workers, and
``ElasticRayExecutor``.
"""

from . import _logger as ray_logger
from ._callbacks import Callback
from ._checkpoint import Checkpoint
from ._config import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ._elastic_executor import ElasticRayExecutor
from ._errors import PlacementGroupTimeoutError, TrainingFailedError
from ._executor import RayExecutor
from ._mlflow_callback import MLflowLoggerCallback
from ._model import full_state_dict, load_sharded, prepare_model, save_sharded
from ._session import TrainContext, get_checkpoint, get_context, get_dataset_shard, report
from ._settings import RaySettings
from ._tbx_callback import TBXLoggerCallback
from ._torch import get_device, prepare_data_loader
from ._trainer import Result, RingTrainer

__all__ = [
    "Callback",
    "Checkpoint",
    "CheckpointConfig",
    "ElasticRayExecutor",
    "FailureConfig",
    "MLflowLoggerCallback",
    "PlacementGroupTimeoutError",
    "RayExecutor",
    "RaySettings",
    "Result",
    "RingTrainer",
    "RunConfig",
    "ScalingConfig",
    "TBXLoggerCallback",
    "TrainContext",
    "TrainingFailedError",
    "full_state_dict",
    "get_checkpoint",
    "get_context",
    "get_dataset_shard",
    "get_device",
    "load_sharded",
    "prepare_data_loader",
    "prepare_model",
    "ray_logger",
    "report",
    "save_sharded",
]
