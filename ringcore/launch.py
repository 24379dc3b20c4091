"""What a launcher needs from the core, in one public module.

ringcore's runners (spark_runner, ray_runner, the estimators, ringcore.testing) start
ranks in processes of their own and tell each one where it is through environment
variables; this module is the contract between a launcher and ``ringcore.init()``:

- the ``RING_*`` environment names a launcher sets for each rank (topology,
  rendezvous, elastic membership, secrets) and :func:`worker_env`, which builds them;
- the job secret (:func:`new_secret`) and the HMAC helpers that authenticate what
  ranks send back to the launcher (:func:`mac`, :func:`verify`, :func:`answer`);
- the key-value store server a launcher may host (:func:`start_store_server`,
  :func:`stop_store_server`, and :func:`hosted_store`: this process's own store);
- the elastic driver (:class:`ElasticDriver`) that publishes the generations of an
  elastic job by one policy (:class:`ElasticPolicy`: min and max workers, reset limit,
  grace period, when to grow and when to give up); a launcher supplies only *who is
  alive* (``(ids, hosts)`` or a :class:`Workers`) and *start one more*, and calls
  :meth:`ElasticDriver.poll` from its watch loop; :func:`forget_job` is for a worker
  process that leaves a job;
- rank order and interfaces across hosts (:func:`host_major_order`,
  :func:`nic_names`, :func:`nics_env`);
- the data-plane backend a running job uses (:func:`backend_name`; :func:`data_plane`
  says which path, shared memory or network, carried its ops), and how a
  launcher bounds the silence of a peer on its own sockets (:func:`bound_silence`);
- GPU checks a launcher runs before starting anything (:func:`check_use_gpu`,
  :func:`pin_gpu`, :class:`GpuUnavailableError`);
- the open registry of data-plane backends (:func:`register_backend`: a factory that
  joins the ring and returns a :class:`Connection` holding a :class:`Backend`);
- pickling a user's function with the modules it needs (:func:`dumps_with_user_code`)
  and typed reads of the environment (:func:`get_env`, :func:`get_float`, ...).

Everything here is stable API between ringtrain's packages; the rooms behind it
(``ringcore.runtime``, ``.engine``, ``.backends``, ...) and the underscore modules are
not, and no other package imports them (tests/project/test_layering.py).
Importing this module imports no framework (torch is loaded by ``init()``).
"""

from __future__ import annotations

import functools
import importlib.metadata
import sys
from types import ModuleType
from typing import Any

import cloudpickle

from ._auth import answer, job_secret, mac, new_secret, verify
from ._config import (
    CROSS_RANK_ENV_VAR,
    CROSS_SIZE_ENV_VAR,
    DEFAULT_ELASTIC_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    ELASTIC_ENV_VAR,
    ELASTIC_LATE_ENV_VAR,
    ELASTIC_TIMEOUT_ENV_VAR,
    HOSTNAME_ENV_VAR,
    IFACE_ENV_VAR,
    LOCAL_RANK_ENV_VAR,
    LOCAL_SIZE_ENV_VAR,
    RANK_ENV_VAR,
    RESET_LIMIT_ENV_VAR,
    SECRET_KEY_ENV_VAR,
    SIZE_ENV_VAR,
    START_TIMEOUT_ENV_VAR,
    STORE_ADDR_ENV_VAR,
    STORE_EXTERNAL_ENV_VAR,
    STORE_PORT_ENV_VAR,
    STORE_PREFIX_ENV_VAR,
    WORKER_ID_ENV_VAR,
    get_bool,
    get_env,
    get_float,
    get_int,
)
from ._errors import GpuUnavailableError
from .backends import devices
from .backends.devices import check_use_gpu
from .backends.protocol import Backend, Connection
from .backends.registry import register_backend
from .elastic.driver import ElasticDriver
from .elastic.policy import ElasticPolicy, Workers
from .elastic.worker import forget_job
from .engine.wire import bound_silence
from .rendezvous.environment import worker_env
from .rendezvous.iface import NICS_ENV_VARS, nic_names, nics_env
from .rendezvous.store_server import hosted_store, start_store_server, stop_store_server
from .rendezvous.topology import host_major_order
from .runtime.state import backend_name, data_plane, local_position

__all__ = [
    "CROSS_RANK_ENV_VAR",
    "CROSS_SIZE_ENV_VAR",
    "DEFAULT_ELASTIC_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "ELASTIC_ENV_VAR",
    "ELASTIC_LATE_ENV_VAR",
    "ELASTIC_TIMEOUT_ENV_VAR",
    "HOSTNAME_ENV_VAR",
    "IFACE_ENV_VAR",
    "LOCAL_RANK_ENV_VAR",
    "LOCAL_SIZE_ENV_VAR",
    "NICS_ENV_VARS",
    "RANK_ENV_VAR",
    "RESET_LIMIT_ENV_VAR",
    "SECRET_KEY_ENV_VAR",
    "SIZE_ENV_VAR",
    "START_TIMEOUT_ENV_VAR",
    "STORE_ADDR_ENV_VAR",
    "STORE_EXTERNAL_ENV_VAR",
    "STORE_PORT_ENV_VAR",
    "STORE_PREFIX_ENV_VAR",
    "WORKER_ID_ENV_VAR",
    "Backend",
    "Connection",
    "ElasticDriver",
    "ElasticPolicy",
    "GpuUnavailableError",
    "Workers",
    "answer",
    "backend_name",
    "bound_silence",
    "check_use_gpu",
    "data_plane",
    "dumps_with_user_code",
    "forget_job",
    "get_bool",
    "get_env",
    "get_float",
    "get_int",
    "host_major_order",
    "hosted_store",
    "job_secret",
    "mac",
    "new_secret",
    "nic_names",
    "nics_env",
    "pin_gpu",
    "register_backend",
    "start_store_server",
    "stop_store_server",
    "verify",
    "worker_env",
]


def pin_gpu(local_rank: int | None = None, local_size: int | None = None) -> Any:
    """``torch.cuda.set_device`` on this rank's GPU; returns the ``torch.device``.

    ``local_rank``/``local_size`` default to this rank's place on its host: the running
    job's topology (after ``init()``), else ``RING_LOCAL_RANK``/``RING_LOCAL_SIZE``.
    Raises :class:`GpuUnavailableError` without CUDA.
    """
    if local_rank is None or local_size is None:
        lr, ls = local_position()
        local_rank = lr if local_rank is None else local_rank
        local_size = ls if local_size is None else local_size
    return devices.pin_gpu(local_rank, local_size)


# -- shipping the user's function to workers ----------------------------------------
# cloudpickle pickles a function by reference when its module can be imported. On a
# cluster the workers import installed packages, but not the user's own modules (a
# ``train.py`` beside the notebook, a test file): those are shipped by value.


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
