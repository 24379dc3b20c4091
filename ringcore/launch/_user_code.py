"""Shipping the user's function to workers with the modules it needs.

cloudpickle pickles a function by reference when its module can be imported. On a
cluster the workers import installed packages, but not the user's own modules (a
``train.py`` beside the notebook, a test file): those are shipped by value.
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from types import ModuleType
from typing import Any

import cloudpickle

__all__ = ["dumps_with_user_code"]


@functools.lru_cache(maxsize=1)
def _installed_top_levels() -> frozenset[str]:
    return frozenset(importlib.metadata.packages_distributions())


def _user_modules(fn: Any) -> list[ModuleType]:
    name = getattr(fn, "__module__", None)
    module = sys.modules.get(name) if name else None
    if module is None or module.__name__ == "__main__" or not getattr(module, "__file__", None):
        return []  # __main__ is pickled by value already
    top = module.__name__.split(".")[0]
    if top in _installed_top_levels() or top in sys.stdlib_module_names:
        return []
    return [module]


def dumps_with_user_code(obj: Any, fn: Any) -> bytes:
    """``cloudpickle.dumps(obj)``, shipping ``fn``'s module by value when it is the
    user's own (not an installed package)."""
    modules = _user_modules(fn)
    for m in modules:
        cloudpickle.register_pickle_by_value(m)
    try:
        return cloudpickle.dumps(obj)
    finally:
        for m in modules:
            cloudpickle.unregister_pickle_by_value(m)
