"""estimators: Spark ML estimators that train with ringtrain's data-parallel ring.

``RingEstimator(model=..., optimizer=..., loss=..., feature_cols=..., label_cols=...)
.fit(df)`` trains a torch ``nn.Module`` on ``num_proc`` Spark tasks and returns a
:class:`RingModel`, whose ``transform(df)`` appends ``<label>__output`` columns.
Intermediate Parquet data and checkpoints live in a :class:`Store`.
``read_tensorboard_scalars(store, run_id)`` reads back the TensorBoard scalars rank 0
wrote under the run's logs folder. A LightningModule or a Keras model trains too, and
another kind of model once its framework is registered (``estimators.frameworks``).
"""

from ._callbacks import Callback
from ._estimator import RingEstimator
from ._model import RingModel
from .store._default import default_store
from .store._store import DBFSLocalStore, FsspecStore, LocalStore, Store, VolumeStore
from .tracking._tensorboard import read_tensorboard_scalars

__all__ = [
    "Callback",
    "DBFSLocalStore",
    "FsspecStore",
    "LocalStore",
    "RingEstimator",
    "RingModel",
    "Store",
    "VolumeStore",
    "default_store",
    "read_tensorboard_scalars",
]
