"""What a torch worker gets from the driver: the :class:`TorchSpec` of a fit.

The model, the optimizer's class, the loss, the metrics and the callbacks travel
cloudpickled (``user_objects``); the optimizer as its param groups (indices into
``model.parameters()``) and its ``state_dict``, so every worker rebuilds it on its own
replica (as Horovod's TorchEstimator does); the torch loop's config as plain data,
its callables (loss constructors, the lr_scheduler, a minibatch function) cloudpickled
beside it (``loop_objects``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import cloudpickle
import torch

from ...data._spec import DataSpec, data_spec_fields
from ._calling import ModelCall
from ._config import TorchConfig
from ._schedule import scheduler_payload

__all__ = ["TorchSpec", "torch_spec"]


@dataclass(frozen=True, kw_only=True)
class TorchSpec(DataSpec):
    """Everything a torch worker needs, as picklable data (no SparkSession)."""

    user_objects: bytes  # cloudpickle of (model, optimizer class, loss, metrics, callbacks)
    optimizer_groups: list[list[int]]  # per param group: indices into model.parameters()
    optimizer_state: dict[str, Any]  # the driver optimizer's state_dict()
    use_gpu: bool = False  # model and batches on cuda:<local rank>
    inmemory_cache_all: bool = False  # read the shard once, serve every epoch from memory
    config: TorchConfig = field(default_factory=TorchConfig)  # callables: in loop_objects
    loop_objects: bytes = b""  # cloudpickle of (loss_constructors, lr_scheduler, minibatch fn)
    call: ModelCall = field(default_factory=ModelCall)  # how the model is called (_calling)


def _optimizer_groups(model: torch.nn.Module, optimizer: Any) -> list[list[int]]:
    index = {id(p): i for i, p in enumerate(model.parameters())}
    return [[index[id(p)] for p in group["params"]] for group in optimizer.param_groups]


def torch_spec(cfg: Any, data: Any, call: ModelCall | None = None) -> TorchSpec:
    """The :class:`TorchSpec` of a fit of ``cfg`` on ``data``; ``call``: how its model
    is called (default: the torch framework's, ``model(*features)``)."""
    config = getattr(cfg, "framework_config", None) or TorchConfig()  # a config made by hand
    loop_objects = (
        config.loss_constructors,
        scheduler_payload(config.lr_scheduler),
        config.train_minibatch_fn,
    )
    return TorchSpec(
        user_objects=cloudpickle.dumps(
            (cfg.model, type(cfg.optimizer), cfg.loss, cfg.metrics, cfg.callbacks)
        ),
        optimizer_groups=_optimizer_groups(cfg.model, cfg.optimizer),
        optimizer_state=cfg.optimizer.state_dict(),
        **data_spec_fields(cfg, data),
        use_gpu=cfg.use_gpu,
        inmemory_cache_all=cfg.inmemory_cache_all,
        # the callables travel in loop_objects (cloudpickle), the plain values in config
        config=replace(config, loss_constructors=None, lr_scheduler=None, train_minibatch_fn=None),
        loop_objects=cloudpickle.dumps(loop_objects) if any(loop_objects) else b"",
        call=call or ModelCall(),
    )
