"""Ray Train's ``prepare_model`` on ringcore's strategies, and the state of a prepared model.

``prepare_model(model, parallel_strategy=...)`` forms the ring (``ringcore.init()``) if
the loop has not, moves the model to ``get_device()`` and sets it up for one strategy:

- ``"ring"`` (the default): the same module, rank 0's parameters and buffers broadcast,
  every parameter hooked so that its gradient is averaged over the ring (an async
  allreduce per gradient as backward produces it, all awaited at the end of backward).
  There is no ``.module`` wrapper, and buffers are not re-broadcast each step as DDP
  does (use ``ringcore.torch.SyncBatchNorm`` for synchronized statistics).
- ``"ddp"``: torch's ``DistributedDataParallel`` on the job's process group (returned
  wrapped, as Ray Train returns it).
- ``"fsdp"``: FSDP2 (``fully_shard``) with ``parallel_strategy_kwargs`` as
  ``FsdpConfig``'s fields; the same module, its parameters sharded over the ranks. The
  optimizer is built after ``prepare_model``, over the sharded parameters.
- ``None``: moved to the device only.

The model keeps its :class:`ringcore.torch.strategies.Prepared` as the attribute
``PREPARED_ATTR`` (under ddp on the wrapper and on the wrapped module), where
:func:`full_state_dict`, :func:`save_sharded` and :func:`load_sharded` find it: one code
path for a loop's checkpoints whatever the strategy.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from ._torch import get_device, ring

if TYPE_CHECKING:
    from ringcore.torch.strategies import Prepared

__all__ = ["PREPARED_ATTR", "full_state_dict", "load_sharded", "prepare_model", "save_sharded"]

PREPARED_ATTR = "_ringtrain_prepared"


def prepare_model(
    model: Any,
    move_to_device: bool = True,
    parallel_strategy: str | None = "ring",
    parallel_strategy_kwargs: dict[str, Any] | None = None,
) -> Any:
    """``model`` set up on this rank for ``parallel_strategy`` (see the module doc); a
    collective: every rank calls it. Returns what the loop calls: the same module under
    ring, fsdp and None, a ``DistributedDataParallel`` under ddp.

    Under ``"fsdp"`` build the optimizer after this call, over the returned model's
    parameters (they are replaced by their shards), as FSDP2 and Ray Train ask.
    ``parallel_strategy_kwargs`` is for ``"fsdp"`` only: ``FsdpConfig``'s fields
    (``param_dtype``, ``reduce_dtype``, ``reshard_after_forward``, ``cpu_offload``,
    ``shard_modules``). A model prepared already comes back as it was prepared."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"prepare_model takes a torch.nn.Module, got {type(model).__name__}")
    config = _config(parallel_strategy, parallel_strategy_kwargs)
    earlier = _prepared_of(model)
    again = earlier is not None and earlier.name == (parallel_strategy or "none")
    if earlier is not None and not again and earlier.name != "none":
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}): this "
            f"{type(earlier.module).__name__} was prepared with "
            f"parallel_strategy={earlier.name!r} already; prepare a model once"
        )
    hvd = ring()
    if again and parallel_strategy not in (None, "ring"):
        return earlier.model  # type: ignore[union-attr]
    if move_to_device:
        model = model.to(get_device())
    if parallel_strategy is None:
        return _keep(_local(model))
    if parallel_strategy == "ring":
        return _keep(_ring_averaged(hvd, model, hooked=again))
    from ringcore.torch.strategies import get_strategy

    return _keep(get_strategy(parallel_strategy).prepare(model, None, config=config))


def full_state_dict(model: Any) -> dict[str, Any]:
    """The whole state of a model ``prepare_model`` returned (or, under ddp, of the
    module it wraps), on CPU, with the unwrapped module's keys: every rank's own
    replica under ring, ddp and None; under fsdp gathered to rank 0 (``{}`` on the
    other ranks) — a collective there, so every rank calls it."""
    return _prepared("full_state_dict", model).full_state_dict()


def save_sharded(
    model: Any, path: str, optimizer: Any = None, storage_options: dict | None = None
) -> None:
    """Each rank writes its shard of ``model``'s state (and ``optimizer``'s, when given)
    under the folder ``path`` (local, or an fsspec URL) with
    ``torch.distributed.checkpoint``; a collective. Under ring, ddp and None the
    replicated state is written once between the ranks, in the same format. Written
    into each rank's own folder and reported together
    (``report(checkpoint=Checkpoint.from_directory(folder))`` on every rank), the
    ranks' files make one checkpoint folder that :func:`load_sharded` reads on any
    number of ranks."""
    run = dataclasses.replace(_prepared("save_sharded", model), optimizer=optimizer)
    run.save_sharded(path, storage_options)


def load_sharded(
    model: Any, path: str, optimizer: Any = None, storage_options: dict | None = None
) -> None:
    """Load a checkpoint :func:`save_sharded` wrote into ``model`` (and ``optimizer``,
    when given; it must have been saved with one), resharded for this job's ranks; a
    collective."""
    run = dataclasses.replace(_prepared("load_sharded", model), optimizer=optimizer)
    run.load_sharded(path, storage_options)


def _config(parallel_strategy: Any, kwargs: Any) -> Any:
    """The strategy's config from ``parallel_strategy_kwargs``; a ``ValueError`` naming
    an unknown strategy, or kwargs given to a strategy that takes none."""
    from ringcore.torch.strategies import FsdpConfig, strategy_names

    names = strategy_names()
    if parallel_strategy is not None and parallel_strategy not in names:
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) is not a strategy; use "
            f"one of {', '.join(map(repr, names))} or None (ring is the default; None only "
            "moves the model to the device)"
        )
    if kwargs is None:
        return None
    if parallel_strategy != "fsdp":
        raise ValueError(
            f"prepare_model(parallel_strategy={parallel_strategy!r}) takes no "
            f"parallel_strategy_kwargs (got {kwargs!r}); they are FsdpConfig's fields, for "
            "parallel_strategy='fsdp' (DistributedDataParallel's keyword arguments are not "
            "passed on: drop them)"
        )
    try:
        return FsdpConfig.of(kwargs)
    except ValueError as exc:
        raise ValueError(f"prepare_model(parallel_strategy_kwargs=...): {exc}") from exc


def _local(model: Any) -> Prepared:
    """``parallel_strategy=None``: this rank's model, synchronised with nothing."""
    from ringcore.torch.strategies import Prepared, Strategy

    class Local(Strategy):
        name = "none"

    return Prepared(Local(), model, model)


def _ring_averaged(hvd: Any, model: Any, hooked: bool) -> Prepared:
    """Rank 0's state on every rank and each gradient averaged over the ring as backward
    produces it (hooked once: ``hooked`` when a ring prepare_model did it already)."""
    import torch

    from ringcore.torch.strategies import Prepared, get_strategy

    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    run = Prepared(get_strategy("ring"), model, model)
    if hvd.size() == 1 or hooked:
        return run
    pending: list[int] = []

    def wait_all() -> None:
        while pending:
            hvd.synchronize(pending.pop(0))

    def hook(name: str):
        def averaged(param: torch.Tensor) -> None:
            if not pending:  # the first gradient of this backward: await them all at its end
                torch.autograd.Variable._execution_engine.queue_callback(wait_all)
            pending.append(
                hvd.allreduce_async_(param.grad, op=hvd.Average, name=f"prepare_model.{name}")
            )

        return averaged

    for name, param in model.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(hook(name))
    return run


class _Kept:
    """A model's :class:`Prepared`, as its attribute. ``copy.deepcopy`` or a pickle of the
    model holds ``None`` there (``__reduce__``): a copy is not part of the ranks'
    collective setup, and copying the Prepared with the model fails (the model refers
    to itself through it; a DDP wrapper holds a process group)."""

    __slots__ = ("run",)

    def __init__(self, run: Prepared):
        self.run = run

    def __reduce__(self) -> tuple:
        return (_nothing, ())


def _nothing() -> None:
    return None


def _keep(run: Prepared) -> Any:
    """Keep ``run`` on the model the loop calls and on the user's module; return the former."""
    kept = _Kept(run)
    for holder in {id(run.model): run.model, id(run.module): run.module}.values():
        setattr(holder, PREPARED_ATTR, kept)
    return run.model


def _prepared_of(model: Any) -> Prepared | None:
    kept = getattr(model, PREPARED_ATTR, None)
    return kept.run if isinstance(kept, _Kept) else None


def _prepared(what: str, model: Any) -> Prepared:
    run = _prepared_of(model)
    if run is None:
        raise ValueError(
            f"{what} takes a model that ray_runner.prepare_model returned; this "
            f"{type(model).__name__} was not prepared (call model = prepare_model(model) first)"
        )
    return run
