"""What every strategy gives: ``check`` (on the driver), ``prepare`` (on each rank) and,
on the prepared model, the operations a training loop needs whatever the strategy."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class Prepared:
    """A model and optimizer set up by a strategy on this rank.

    ``model`` is what the loop calls (a ``DistributedDataParallel`` wrapper under ddp);
    ``module`` is the user's module (the same object under ring and fsdp, whose
    ``fully_shard`` works in place); ``optimizer`` is the one to step (None if none was
    given)."""

    strategy: Strategy
    model: Any
    module: Any
    optimizer: Any = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.strategy.name

    @property
    def sharded(self) -> bool:
        return self.strategy.sharded

    def no_sync(self) -> contextlib.AbstractContextManager:
        """Backward passes inside do not synchronise gradients (accumulation steps); the
        first backward after it does, for everything accumulated."""
        return self.strategy.no_sync(self)

    def before_step(self) -> None:
        """Gradients final on this rank (call before reading them: clipping, logging)."""
        self.strategy.before_step(self)

    def step(self) -> None:
        """``optimizer.step()`` once this rank's gradients are final (under ring: after
        the ring's averaging, which is not done twice), then ``zero_grad()``."""
        self.strategy.step(self)

    def local_step(self) -> contextlib.AbstractContextManager:
        """Inside, ``optimizer.step()`` steps on this rank's gradients as they are: for a
        caller that steps the optimizer itself after :meth:`before_step` (a GradScaler's
        step), or that initialises an empty optimizer state by a step. Under ring it skips
        the ring's reduction; ddp and fsdp reduce in backward, so it changes nothing."""
        return self.strategy.local_step(self)

    def clip_grad_norm_(self, max_norm: float) -> Any:
        """Clip by the norm of the whole model's gradient (every shard counted)."""
        import torch

        self.before_step()
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def full_state_dict(self) -> dict[str, Any]:
        """The whole model's state on CPU, as the unwrapped module's ``state_dict()``:
        on every rank for ring and ddp, on rank 0 (``{}`` elsewhere) for fsdp. A
        collective under fsdp: every rank calls it."""
        return self.strategy.full_state_dict(self)

    def load_full_state_dict(self, state: dict[str, Any]) -> None:
        """Load rank 0's full state (other ranks may pass ``{}``) into every rank's model."""
        self.strategy.load_full_state_dict(self, state)

    def save_sharded(self, path: str, storage_options: dict | None = None) -> None:
        """Each rank writes its shard of the model and optimizer state under ``path`` (a
        folder: local, or any fsspec URL such as ``s3://``); a collective."""
        from ._checkpoint import save_sharded

        save_sharded(self, path, storage_options)

    def load_sharded(self, path: str, storage_options: dict | None = None) -> None:
        """Read a checkpoint ``save_sharded`` wrote, on any number of ranks (resharded)."""
        from ._checkpoint import load_sharded

        load_sharded(self, path, storage_options)


class Strategy:
    """The replica behaviour that ring and ddp share; fsdp overrides most of it."""

    name: ClassVar[str] = ""
    sharded: ClassVar[bool] = False

    def check(self, model: Any, config: Any = None) -> None:
        """Raise ``ValueError`` naming the problem if this strategy cannot train
        ``model`` with ``config`` (run on the driver before any job)."""
        import torch

        if not isinstance(model, torch.nn.Module):
            raise ValueError(
                f"strategy={self.name!r} trains a torch.nn.Module; got {type(model).__name__}"
            )
        if config is not None:
            raise ValueError(
                f"fsdp_config is for strategy='fsdp'; strategy={self.name!r} takes none "
                "(drop fsdp_config or use strategy='fsdp')"
            )

    def prepare(
        self, model: Any, optimizer: Any = None, *, config: Any = None,
        backward_passes_per_step: int = 1,
    ) -> Prepared:  # fmt: skip
        """Set ``model`` (and ``optimizer``, over its parameters) up on this rank; a
        collective. ``backward_passes_per_step``: backward passes per optimizer step
        (gradient accumulation); wrap all but the last of each step's passes in
        :meth:`Prepared.no_sync`."""
        raise NotImplementedError

    @contextlib.contextmanager
    def no_sync(self, run: Prepared) -> Iterator[None]:
        yield

    def before_step(self, run: Prepared) -> None:
        pass

    def step(self, run: Prepared) -> None:
        run.optimizer.step()
        run.optimizer.zero_grad()

    def local_step(self, run: Prepared) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def full_state_dict(self, run: Prepared) -> dict[str, Any]:
        return {k: v.detach().cpu() for k, v in run.module.state_dict().items()}

    def load_full_state_dict(self, run: Prepared, state: dict[str, Any]) -> None:
        from ... import torch as hvd

        if hvd.rank() == 0:
            run.module.load_state_dict(state)
        hvd.broadcast_parameters(run.module.state_dict(), root_rank=0)
