"""``fsdp``: FSDP2 (``torch.distributed.fsdp.fully_shard``) — parameters, gradients and
optimizer state sharded over the ranks of the job's process group."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from ._base import Prepared, Strategy
from ._config import FsdpConfig
from ._group import device_of, ensure_process_group, strategy_group
from ._optimizer import names_of, rebuild


def units(model: Any, config: FsdpConfig) -> list[Any]:
    """The submodules that become FSDP units before the root, innermost first: those of
    the classes ``config.shard_modules`` names, else every module of every
    ``nn.ModuleList`` (a transformer's layers)."""
    import torch

    found: list[Any] = []
    if config.shard_modules is not None:
        wanted = set(config.shard_modules)
        found = [m for m in model.modules() if m is not model and type(m).__name__ in wanted]
    else:
        for m in model.modules():
            if isinstance(m, torch.nn.ModuleList):
                found.extend(c for c in m if any(True for _ in c.parameters()))
    unique = list({id(m): m for m in found}.values())
    return list(reversed(unique))  # children of nested lists before their parents


def _kwargs(config: FsdpConfig) -> dict[str, Any]:
    import torch
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    kwargs: dict[str, Any] = {"reshard_after_forward": config.reshard_after_forward}
    if config.param_dtype or config.reduce_dtype:
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=getattr(torch, config.param_dtype) if config.param_dtype else None,
            reduce_dtype=getattr(torch, config.reduce_dtype) if config.reduce_dtype else None,
        )
    if config.cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    return kwargs


class FsdpStrategy(Strategy):
    name = "fsdp"
    sharded = True

    def check(self, model: Any, config: Any = None) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"strategy='fsdp' shards a torch.nn.Module; got {type(model).__name__}"
            )
        cfg = FsdpConfig.of(config)
        if not any(p.requires_grad for p in model.parameters()):
            raise ValueError(
                f"strategy='fsdp' shards parameters, and {type(model).__name__} has no "
                "trainable ones; use strategy='ring' (or give the model parameters)"
            )
        if cfg.shard_modules is not None:
            present = {type(m).__name__ for m in model.modules()}
            missing = [n for n in cfg.shard_modules if n not in present]
            if missing:
                raise ValueError(
                    f"fsdp_config shard_modules names {', '.join(map(repr, missing))}, which "
                    f"{type(model).__name__} does not contain; its module classes are "
                    f"{', '.join(sorted(present))}"
                )

    def prepare(
        self, model: Any, optimizer: Any = None, *, config: Any = None,
        backward_passes_per_step: int = 1,
    ) -> Prepared:  # fmt: skip
        from torch.distributed.fsdp import fully_shard

        self.check(model, config)
        cfg = FsdpConfig.of(config)
        ensure_process_group()
        groups = names_of(model, optimizer) if optimizer is not None else None
        ring = strategy_group(device_of(model))
        _same_start(model, ring)
        kwargs = _kwargs(cfg)
        if ring is not None:  # on the CPU: shards gathered and reduced through shared memory
            from torch.distributed.device_mesh import DeviceMesh

            kwargs["mesh"] = DeviceMesh.from_group(ring, "cpu")
        for unit in units(model, cfg):
            fully_shard(unit, **kwargs)
        fully_shard(model, **kwargs)
        if optimizer is not None and groups is not None:
            optimizer = rebuild(optimizer, model, groups)
        return Prepared(self, model, model, optimizer, {"config": cfg})

    @contextlib.contextmanager
    def no_sync(self, run: Prepared) -> Iterator[None]:
        run.model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            run.model.set_requires_gradient_sync(True)

    def full_state_dict(self, run: Prepared) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        return get_model_state_dict(run.module, options=options)

    def load_full_state_dict(self, run: Prepared, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(run.module, state, options=options)


def _same_start(model: Any, group: Any = None) -> None:
    """Rank 0's parameters and buffers on every rank before sharding (``fully_shard``
    shards each rank's own values; DDP broadcasts, FSDP does not), through ``group``
    (None: the default group; rank 0 is rank 0 of either)."""
    import torch.distributed as dist

    if dist.get_world_size() == 1:
        return
    for tensor in list(model.parameters()) + list(model.buffers()):
        dist.broadcast(tensor.data, src=0, group=group)
