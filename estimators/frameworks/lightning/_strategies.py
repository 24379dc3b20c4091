"""Which Lightning strategy every rank's Trainer runs: ringtrain's ``RingStrategy`` (no
``trainer_args["strategy"]``), or Lightning's own ``DDPStrategy`` on the job's process
group (``trainer_args={"strategy": "ddp"}``).

Under ``"ddp"`` the Trainer is the one ``torchrun`` would start: every Spark task has
torchrun's variables (``RANK``, ``LOCAL_RANK``, ``GROUP_RANK``, ...), read by Lightning's
``TorchElasticEnvironment``; ``devices`` is the ranks on this host and ``num_nodes`` the
hosts, which Lightning checks against ``WORLD_SIZE``; ringcore formed the default
``torch.distributed`` group at ``init()``, so Lightning's ``DDPStrategy`` opens none and
wraps the module in ``DistributedDataParallel`` on that group. Lightning numbers a rank
``node_rank * devices + local_rank``, so every host must run the same number of ranks
(:func:`check_layout`, on every rank before the Trainer starts).

``"fsdp"`` is refused before any job: Lightning 2.6's ``FSDPStrategy`` (FSDP1) refuses
any accelerator but CUDA (its accelerator connector), so it cannot run on the CPU ranks
over Gloo where ringtrain's tests run. Lightning's FSDP2 strategy
(``ModelParallelStrategy``) does run there, but it is not "fsdp" to a Lightning user
(the module shards itself in ``configure_model``, and its checkpoints are DCP folders),
and it is not offered either. FSDP2 is ``RingEstimator(strategy='fsdp')`` on the
module's network as a ``torch.nn.Module``.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import torch

import ringcore.torch as hvd

from ._trainer_args import FSDP_NOT_OFFERED, LIGHTNING_STRATEGIES, check_strategy

__all__ = ["check_layout", "check_strategy_object", "lightning_strategy"]


def check_strategy_object(package: Any, value: Any) -> None:
    """Raise ValueError for a ``trainer_args["strategy"]`` that is neither an accepted
    name nor a ``DDPStrategy`` of ``package`` started by the launcher (driver side)."""
    if value is None or isinstance(value, str):
        check_strategy(value)
        return
    if isinstance(value, package.strategies.FSDPStrategy):
        raise ValueError(
            f"trainer_args sets strategy={value!r}, which is not offered: {FSDP_NOT_OFFERED}."
        )
    ddp = package.strategies.DDPStrategy
    if type(value) is not ddp or getattr(value, "_start_method", "popen") != "popen":
        raise ValueError(
            f"trainer_args sets strategy={value!r}, which ringtrain does not run; pass one "
            f"of {', '.join(map(repr, LIGHTNING_STRATEGIES))} or a {package.__name__}.strategies.DDPStrategy(...) (its "
            "default start_method; find_unused_parameters, static_graph and the other DDP "
            "keywords as you like), or none for ringtrain's RingStrategy."
        )
    for name in ("parallel_devices", "cluster_environment"):
        if getattr(value, name, None):
            raise ValueError(
                f"trainer_args sets a DDPStrategy with {name} set, which ringtrain sets "
                f"itself from the job (the Spark tasks are the processes); drop {name}."
            )


def lightning_strategy(pl: Any, value: Any, device: torch.device) -> tuple[Any, int, int]:
    """``(strategy, devices, num_nodes)`` for the Trainer of this rank under Lightning's
    ``DDPStrategy`` (``value``: an accepted name or a ``DDPStrategy``): the rank's own
    device at its local rank, the hosts' torchrun environment; after
    :func:`check_layout`."""
    strategy = pl.strategies.StrategyRegistry.get(value) if isinstance(value, str) else value
    strategy.parallel_devices = [device] * hvd.local_size()  # root_device: [local_rank]
    environments = importlib.import_module(f"{pl.__name__}.plugins.environments")
    strategy.cluster_environment = environments.TorchElasticEnvironment()
    return strategy, hvd.local_size(), hvd.cross_size()


def check_layout() -> None:
    """Every rank: raise the same ValueError when the job's layout is not one Lightning
    can express (each host the same number of ranks, numbered ``host * ranks per host +
    local rank``, torchrun's variables set); a collective."""
    mine = (
        hvd.rank(),
        hvd.local_rank(),
        hvd.local_size(),
        int(os.environ.get("GROUP_RANK", "-1")),
        os.environ.get("TORCHELASTIC_RUN_ID") is not None,
    )
    layout = hvd.allgather_object(mine, name="ringtrain.lightning.layout")
    per_host = sorted({local_size for _, _, local_size, _, _ in layout})
    if len(per_host) > 1:
        raise ValueError(
            f"trainer_args={{'strategy': 'ddp'}} needs the same number of ranks on every "
            f"host (Lightning's devices), but the job's hosts run {per_host} ranks; give "
            "every executor the same task slots (spark.executor.cores / spark.task.cpus), "
            "or drop 'strategy' for ringtrain's RingStrategy, which takes any layout."
        )
    for rank, local_rank, local_size, group_rank, elastic in layout:
        if not elastic or rank != group_rank * local_size + local_rank:
            raise ValueError(
                f"trainer_args={{'strategy': 'ddp'}}: rank {rank} (local rank {local_rank} "
                f"of {local_size}, GROUP_RANK {group_rank}) is not where Lightning's "
                "TorchElasticEnvironment puts it (GROUP_RANK * devices + LOCAL_RANK, with "
                "TORCHELASTIC_RUN_ID set); run it under the Spark or Ray launcher, or drop "
                "'strategy' for ringtrain's RingStrategy."
            )
