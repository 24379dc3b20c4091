"""Stand-in for MNIST's download in Horovod's examples (tools/examples.py puts this
folder on ``PYTHONPATH`` of the examples it runs; nothing else imports it).

There is no internet here, and ``keras.datasets.mnist.load_data`` checks the file it
finds against MNIST's hash, so a local file cannot simply take its place in Keras's
cache. When Keras's ``keras.src.datasets.mnist`` module is imported, its ``get_file``
is replaced by one that returns the small generated file named by
``RINGTRAIN_EXAMPLES_MNIST`` (same arrays and dtypes as MNIST, fewer rows); every
other module is left alone.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from typing import Any

MNIST_ENV_VAR = "RINGTRAIN_EXAMPLES_MNIST"
_MODULE = "keras.src.datasets.mnist"


def _local_mnist(fname: Any = None, origin: Any = None, **kwargs: Any) -> str:
    return os.environ[MNIST_ENV_VAR]


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: Any):
        self.inner = inner

    def create_module(self, spec: Any) -> Any:
        return self.inner.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.inner.exec_module(module)
        module.get_file = _local_mnist


class _MnistFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != _MODULE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _PatchingLoader(spec.loader)
                return spec
        return None


if os.environ.get(MNIST_ENV_VAR):
    sys.meta_path.insert(0, _MnistFinder())
