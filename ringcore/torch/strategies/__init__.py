"""How a torch model is trained across the ranks: ``ring``, ``ddp`` or ``fsdp``.

One strategy object per name, in an open registry (``register_strategy``), used by
every launcher's training path — ``RingEstimator(strategy=...)``,
``ray_runner.prepare_model(parallel_strategy=...)`` — and by users' own loops::

    from ringcore.torch.strategies import get_strategy

    strategy = get_strategy("fsdp")
    strategy.check(model)                   # before any job: raises naming the problem
    run = strategy.prepare(model, optimizer, config={"reshard_after_forward": False})
    loss = run.model(x).sum(); loss.backward(); run.optimizer.step()
    state = run.full_state_dict()           # the whole model, on rank 0 (a collective)

- ``ring`` — Horovod's way: every rank holds the whole model; the optimizer becomes
  ``hvd.DistributedOptimizer`` (gradients averaged over ringcore's ring).
- ``ddp`` — torch's ``DistributedDataParallel`` on the job's process group.
- ``fsdp`` — FSDP2 (``fully_shard``): parameters, gradients and optimizer state are
  sharded over the ranks; by default each module of every ``nn.ModuleList`` (the
  repeated blocks: transformer layers) is a unit of its own, then the root.
  The optimizer is rebuilt over the sharded parameters with the same class, parameter
  groups and hyper-parameters. :class:`FsdpConfig` holds its knobs.
"""

from __future__ import annotations

from ._base import Prepared, Strategy
from ._config import FsdpConfig
from ._registry import STRATEGY_NAMES, get_strategy, register_strategy, strategy_names

__all__ = [
    "STRATEGY_NAMES",
    "FsdpConfig",
    "Prepared",
    "Strategy",
    "get_strategy",
    "register_strategy",
    "strategy_names",
]
