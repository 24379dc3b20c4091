"""The name -> strategy table (open: ``register_strategy``)."""

from __future__ import annotations

from collections.abc import Callable

from ._base import Strategy

STRATEGY_NAMES = ("ring", "ddp", "fsdp")  # the built-in ones, in the order the docs give
_FACTORIES: dict[str, Callable[[], Strategy]] = {}


def register_strategy(name: str, factory: Callable[[], Strategy]) -> None:
    """Make ``get_strategy(name)`` return ``factory()`` (replaces a registered name)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a strategy's name must be a non-empty string, got {name!r}")
    _FACTORIES[name] = factory


def strategy_names() -> list[str]:
    _builtins()
    return list(_FACTORIES)


def get_strategy(name: str) -> Strategy:
    """The strategy registered as ``name``; an unknown name raises ``ValueError`` naming
    it and every known one."""
    _builtins()
    if name not in _FACTORIES:
        raise ValueError(
            f"strategy={name!r} is not a known strategy; use one of "
            f"{', '.join(repr(n) for n in _FACTORIES)} (or register_strategy() your own)"
        )
    return _FACTORIES[name]()


def _builtins() -> None:
    if "ring" in _FACTORIES:
        return
    from ._ddp import DdpStrategy
    from ._fsdp import FsdpStrategy
    from ._ring import RingStrategy

    for factory in (RingStrategy, DdpStrategy, FsdpStrategy):
        _FACTORIES.setdefault(factory.name, factory)
