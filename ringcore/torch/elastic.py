"""Elastic training, as ``horovod.torch.elastic``: the job goes on when workers die.

::

    state = elastic.TorchState(model, optimizer, sampler=sampler, epoch=0)

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for batch in loader:          # the sampler skips what was already processed
                step(batch)
                state.sampler.record_batch(i, batch_size)
                state.commit()            # a cheap, collective checkpoint in memory
            state.sampler.set_epoch(state.epoch + 1)

    train(state)

When a collective fails (a peer died: ``RingInternalError``) every survivor restores
the last commit, leaves the ring, waits for the launcher's next generation of members
(the parent of ``ringcore.testing.run_workers(..., elastic=True)``, which outlives
every rank), re-forms the ring with the ranks that remain, syncs the state from the
new rank 0 and calls the function again. When workers are added, ``commit()`` raises
:class:`HostsUpdatedInterrupt` and the new ranks get the state from rank 0.
"""

from __future__ import annotations

import copy
import functools
import random
from collections.abc import Callable
from typing import Any

import torch

from .. import _config as cfg
from .._errors import RingError, RingInternalError
from ..elastic.worker import HostsUpdatedInterrupt, hosts_updated, is_elastic, leave, rejoin
from ..runtime.lifecycle import init, shutdown
from ..runtime.state import is_initialized, rank, size
from ._collectives import allgather_object, broadcast_object
from ._state import broadcast_optimizer_state, broadcast_parameters

__all__ = ["ElasticSampler", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]


class State:
    """What a worker must keep across a change of the ring: ``commit`` saves it,
    ``restore`` goes back to the last commit, ``sync`` copies rank 0's to everyone."""

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], None]] = []

    def register_reset_callbacks(self, callbacks: list[Callable[[], None]]) -> None:
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        for callback in self._reset_callbacks:
            callback()

    def commit(self) -> None:
        """Save the state, then :meth:`check_host_updates`."""
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise :class:`HostsUpdatedInterrupt` when the launcher has published a newer
        generation of the ring than the one this worker runs in (Horovod's method of the
        same name; ``commit`` calls it)."""
        if hosts_updated():
            raise HostsUpdatedInterrupt(skip_sync=False)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """Picklable attributes (``ObjectState(epoch=0, batch=0)``; read and set them as
    ``state.epoch``)."""

    def __init__(self, **kwargs: Any):
        super().__init__()
        self._names = list(kwargs)
        for k, v in kwargs.items():
            setattr(self, k, v)
        self._saved: dict[str, Any] = {}
        self.save()

    def _values(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in self._names}

    def save(self) -> None:
        self._saved = copy.deepcopy(self._values())

    def restore(self) -> None:
        for k, v in copy.deepcopy(self._saved).items():
            setattr(self, k, v)

    def sync(self) -> None:
        values = broadcast_object(self._values(), root_rank=0, name="elastic.objects")
        for k, v in values.items():
            setattr(self, k, v)
        self.save()


class ElasticSampler(torch.utils.data.Sampler):
    """Shards ``range(len(dataset))`` over the ranks and remembers what was processed,
    so that after a change of the ring the rest of the epoch is shared out among the
    ranks that remain — no sample repeated, none skipped. Record each batch with
    ``record_batch``; the ranks' records are merged at every ``commit()``."""

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0):
        self.length = dataset if isinstance(dataset, int) else len(dataset)
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0
        self.processed: set[int] = set()
        self.reset()

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.processed = set()
        self.reset()

    def reset(self) -> None:
        """Re-shard what is left of this epoch over the current ranks."""
        order = list(range(self.length))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        remaining = [i for i in order if i not in self.processed]
        r, n = (rank(), size()) if is_initialized() else (0, 1)
        self.indices = remaining[r::n]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        self.record_indices(self.indices[batch_idx * batch_size : (batch_idx + 1) * batch_size])

    def record_indices(self, indices: list[int]) -> None:
        self.processed.update(int(i) for i in indices)

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "processed": sorted(self.processed)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = state["epoch"]
        self.processed = set(state["processed"])
        self.reset()

    def __iter__(self):
        return iter(list(self.indices))

    def __len__(self) -> int:
        return len(self.indices)


class TorchState(ObjectState):
    """A model, an optimizer and any other attributes (an :class:`ElasticSampler`
    among them) kept across changes of the ring."""

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        **kwargs: Any,
    ):
        self.model, self.optimizer = model, optimizer
        self._samplers = {k: v for k, v in kwargs.items() if isinstance(v, ElasticSampler)}
        others = {k: v for k, v in kwargs.items() if k not in self._samplers}
        for k, v in self._samplers.items():
            setattr(self, k, v)
        self._collective_save = (
            False  # building the state is local: ranks may build it at different times
        )
        super().__init__(**others)
        self._collective_save = True

    def save(self) -> None:
        # The collective part first: if a peer dies here, nothing of this commit is kept.
        merged = {}
        for k, sampler in self._samplers.items():
            processed = sampler.processed
            if (
                self._collective_save and is_initialized() and size() > 1
            ):  # merge every rank's records
                processed = set().union(
                    *allgather_object(sorted(processed), name=f"elastic.sampler.{k}")
                )
            merged[k] = processed
        for k, processed in merged.items():
            self._samplers[k].processed = processed
        self._sampler_states = {k: s.state_dict() for k, s in self._samplers.items()}
        super().save()
        self._model_state = (
            copy.deepcopy(self.model.state_dict()) if self.model is not None else None
        )
        self._opt_state = (
            copy.deepcopy(self.optimizer.state_dict()) if self.optimizer is not None else None
        )

    def restore(self) -> None:
        super().restore()
        if self.model is not None and self._model_state is not None:
            self.model.load_state_dict(self._model_state)
        if self.optimizer is not None and self._opt_state is not None:
            self.optimizer.load_state_dict(self._opt_state)
        for k, state in self._sampler_states.items():
            self._samplers[k].load_state_dict(state)

    def sync(self) -> None:
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), root_rank=0)
        if self.optimizer is not None:
            broadcast_optimizer_state(self.optimizer, root_rank=0)
        for k, sampler in self._samplers.items():
            sampler.load_state_dict(
                broadcast_object(sampler.state_dict(), root_rank=0, name=f"elastic.sampler.{k}")
            )
        super().sync()


def run(func: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``func(state, ...)``; on ``RingInternalError`` restore the last commit, on
    ``HostsUpdatedInterrupt`` keep it, re-form the ring with the workers that remain
    (or were added), sync the state from rank 0 and call ``func`` again.
    ``RING_RESET_LIMIT`` bounds the number of re-formations (0: no bound)."""

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not is_initialized():
            init()
        limit = cfg.get_int(cfg.RESET_LIMIT_ENV_VAR, 0)
        resets, skip_sync = 0, False
        while True:
            if not skip_sync:
                state.sync()
            try:
                return func(state, *args, **kwargs)
            except RingInternalError:
                if not is_elastic():
                    raise
                state.restore()
                skip_sync = False
            except HostsUpdatedInterrupt as exc:
                skip_sync = exc.skip_sync
            except BaseException:  # the user's code failed here: this worker is out
                leave()
                raise
            resets += 1
            if limit and resets > limit:
                raise RingError(
                    f"the ring was re-formed {resets} times, more than {cfg.RESET_LIMIT_ENV_VAR}={limit}"
                )
            rejoin(init, shutdown)
            for sampler in getattr(state, "_samplers", {}).values():
                sampler.reset()
            state.on_reset()

    return wrapper
