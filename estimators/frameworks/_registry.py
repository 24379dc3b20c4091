"""The framework registry: a name → factory table with a public ``register_framework``.

As Lightning's ``StrategyRegistry`` and torch elastic's rendezvous handlers: a new
framework is a folder and one register line, and the fit path finds a model's framework
here (:func:`framework_of`) instead of branching on it. Each entry has a ``detect``
function (does a model belong to this framework?) and a ``factory`` that makes the
:class:`~._base.Framework` object, on first use. Detection asks the newest registration
first, so a framework for a subclass of another's models (a LightningModule is a torch
``nn.Module``) registers after it and wins. A detector must not import its framework's
package: a model of that framework exists only once the user imported it (look in
``sys.modules``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ._base import Framework

__all__ = [
    "foreign_param",
    "framework_of",
    "get_framework",
    "register_framework",
    "registered_frameworks",
]


@dataclass(frozen=True)
class _Entry:
    factory: Callable[[], Framework]
    detect: Callable[[Any], bool]
    takes: str  # what its models are, for messages: "a torch.nn.Module"


_ENTRIES: dict[str, _Entry] = {}  # in registration order
_MADE: dict[str, Framework] = {}
_LOCK = threading.Lock()


def register_framework(
    name: str,
    factory: Callable[[], Framework],
    *,
    detect: Callable[[Any], bool],
    takes: str,
    override: bool = False,
) -> None:
    """Register the framework ``name``: ``factory()`` makes its :class:`Framework` (whose
    ``name`` is ``name``), ``detect(model)`` tells whether ``model`` is one of its models,
    ``takes`` says what those are ("a torch.nn.Module"). A name registered already is
    refused unless ``override``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_framework takes a non-empty name, got {name!r}")
    for what, value in (("factory", factory), ("detect", detect)):
        if not callable(value):
            raise TypeError(f"register_framework({name!r}): {what} must be callable, got {value!r}")
    with _LOCK:
        if name in _ENTRIES and not override:
            raise ValueError(
                f"a framework named {name!r} is registered already; pass override=True to "
                "replace it, or register yours under another name."
            )
        _ENTRIES[name] = _Entry(factory, detect, takes)
        _MADE.pop(name, None)


def registered_frameworks() -> list[str]:
    """The registered names, in registration order."""
    return list(_ENTRIES)


def get_framework(name: str) -> Framework:
    """The :class:`Framework` registered under ``name`` (made on first use)."""
    with _LOCK:
        entry = _ENTRIES.get(name)
        if entry is None:
            raise ValueError(
                f"unknown framework {name!r}; ringtrain knows {', '.join(_ENTRIES)}. "
                "Register yours with estimators.frameworks.register_framework."
            )
        if name not in _MADE:
            framework = entry.factory()
            if framework.name != name:
                raise ValueError(
                    f"the framework registered as {name!r} is named {framework.name!r}; "
                    "give its Framework subclass name = the registered name."
                )
            _MADE[name] = framework
        return _MADE[name]


def framework_of(model: Any) -> Framework:
    """The framework of ``model``: the newest registration whose ``detect`` takes it;
    ValueError naming what the registered frameworks take otherwise."""
    for name in reversed(registered_frameworks()):
        if _ENTRIES[name].detect(model):
            return get_framework(name)
    takes = [entry.takes for entry in _ENTRIES.values()] or ["a model of a registered framework"]
    listed = f"{', '.join(takes[:-1])} or {takes[-1]}" if len(takes) > 1 else takes[0]
    raise ValueError(
        f"model must be {listed}, got {type(model).__name__}. Set it with setModel(...)."
    )


def foreign_param(
    framework: Framework,
    owned: Callable[[Framework], Mapping[str, Any]],
    value_of: Callable[[str], Any],
) -> tuple[Framework, str, Any] | None:
    """The first param that only another registered framework reads and that is set, for
    a model of ``framework``: ``(that framework, the param, its value)``, None if none.
    ``owned(f)``: the params ``f`` reads, each with its unset value; ``value_of(param)``:
    the param's value where it is set (the estimator's, the model's)."""
    mine = owned(framework)
    for name in registered_frameworks():
        owner = get_framework(name)
        for param, unset in owned(owner).items():
            if param in mine:
                continue
            value = value_of(param)
            if value is None or value is unset or value == unset:
                continue
            return owner, param, value
    return None
