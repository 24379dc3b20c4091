"""The package named ``horovod`` that Horovod's suites and examples import, on ringcore.

Its modules re-export ringcore's bindings (``horovod.torch`` -> ``ringcore.torch`` and so
on) plus the few harness helpers Horovod's tests import. ``tools/conformance.py`` and
``tools/examples.py`` write it into their temporary folder (:func:`write_shim`); nothing of
Horovod is copied here.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

SHIM = {
    "horovod/__init__.py": '''
        """A shim: Horovod's import names on ringcore (tools/conformance.py writes it)."""
        import os

        # As horovodrun --gloo: the tests read HOROVOD_RANK to know they run under Gloo.
        __version__ = "0.28.1"
    ''',
    "horovod/torch/__init__.py": """
        from ringcore.torch import *  # noqa: F403
        from ringcore.torch import __all__  # noqa: F401
        from . import mpi_ops  # noqa: F401
    """,
    "horovod/torch/mpi_ops.py": """
        from ringcore.torch import *  # noqa: F403
    """,
    "horovod/torch/elastic/__init__.py": """
        from ringcore.torch.elastic import *  # noqa: F403
    """,
    "horovod/tensorflow/__init__.py": """
        from ringcore.tensorflow import *  # noqa: F403
        from ringcore.tensorflow import __all__  # noqa: F401
        from . import elastic, util  # noqa: F401
        from .util import _executing_eagerly  # noqa: F401  (a harness helper of Horovod's)
    """,
    "horovod/tensorflow/elastic.py": """
        from ringcore.tensorflow.elastic import *  # noqa: F403
    """,
    "horovod/tensorflow/keras/elastic.py": """
        from ringcore.keras.elastic import *  # noqa: F403
    """,
    "horovod/tensorflow/util.py": """
        import tensorflow as tf


        def _executing_eagerly():
            return tf.executing_eagerly()
    """,
    "horovod/tensorflow/keras/__init__.py": """
        from ringcore.keras import *  # noqa: F403
        from ringcore.keras import __all__  # noqa: F401
        from ringcore.keras import callbacks  # noqa: F401
        try:
            from ringcore.keras import elastic  # noqa: F401
        except ImportError:
            pass
    """,
    "horovod/keras/__init__.py": """
        from horovod.tensorflow.keras import *  # noqa: F403
        from horovod.tensorflow.keras import callbacks  # noqa: F401
        try:
            from horovod.tensorflow.keras import elastic  # noqa: F401
        except ImportError:
            pass
    """,
    "horovod/common/__init__.py": "",
    "horovod/common/util.py": '''
        """The test-harness helpers Horovod's tests import from horovod.common.util."""
        import contextlib
        import os

        from packaging import version as _version

        import ringcore as _caps


        def gloo_built(verbose=False):
            return _caps.gloo_built()


        def mpi_built(verbose=False):
            return _caps.mpi_built()


        def nccl_built(verbose=False):
            return _caps.nccl_built()


        def ccl_built(verbose=False):
            return False


        def ddl_built(verbose=False):
            return False


        @contextlib.contextmanager
        def env(**kwargs):
            saved = {k: os.environ.get(k) for k in kwargs if kwargs[k] is not None}
            os.environ.update({k: v for k, v in kwargs.items() if v is not None})
            try:
                yield
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v


        def is_version_greater_equal_than(ver, target):
            return _version.parse(ver) >= _version.parse(target)


        def is_iterable(x):
            try:
                iter(x)
            except TypeError:
                return False
            return True
    ''',
    "horovod/runner/__init__.py": "",
    "horovod/runner/util/__init__.py": "",
    "horovod/runner/util/threads.py": '''
        """in_thread, as the tests' helpers use it."""
        import threading


        def in_thread(target, args=(), name=None, daemon=True, silent=False):
            def run():
                try:
                    target(*args)
                except Exception:
                    if not silent:
                        raise

            thread = threading.Thread(target=run, name=name, daemon=daemon)
            thread.start()
            return thread
    ''',
}


def write_shim(folder: Path, modules: dict[str, str]) -> None:
    """Write ``modules`` (a path under ``folder`` -> its source) into ``folder``."""
    for rel, text in modules.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())


# What Horovod's examples import beyond the suites' modules (tools/examples.py).
EXAMPLES_SHIM = {
    **SHIM,
    # as Horovod's package, `import horovod.torch as hvd` brings `hvd.elastic` (importing
    # ringcore.torch alone does not import ringcore.torch.elastic)
    "horovod/torch/__init__.py": """
        from ringcore.torch import *  # noqa: F403
        from ringcore.torch import __all__  # noqa: F401
        from . import elastic, mpi_ops  # noqa: F401
    """,
    "horovod/torch/elastic/sampler.py": """
        from ringcore.torch.elastic import ElasticSampler  # noqa: F401
    """,
    "horovod/ray/__init__.py": """
        from ray_runner import ElasticRayExecutor, RayExecutor, ray_logger  # noqa: F401
    """,
}
