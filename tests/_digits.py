"""The digits demo (``examples/digits_demo.py``, what ``make demo`` runs) for the tests.

Tests fit on its DataFrame (``demo.digits_frame(spark)``), its seed (``demo.SEED``) and
its estimator (``demo.make_estimator(store)``): ``from _digits import demo``. The demo
is a script, not a package module, so it is loaded from its file; the Spark workers
cannot import it, so code sent to them (a LightningModule made in a test) must not name
``demo``: copy what it needs into the test module (``SEED = demo.SEED``).
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from types import ModuleType

__all__ = ["demo"]

_PATH = pathlib.Path(__file__).resolve().parents[1] / "examples" / "digits_demo.py"


def _load() -> ModuleType:
    name = "digits_demo"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, _PATH)
    assert spec is not None and spec.loader is not None, _PATH
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


demo = _load()
