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
- pickling a user's function with the modules it needs (:func:`dumps_with_user_code`)
  and typed reads of the environment (:func:`get_env`, :func:`get_float`, ...).

Everything here is stable API between ringtrain's packages; the underscore modules
behind it are not, and no other package imports them (tests/test_layering.py).
Importing this module imports no framework (torch is loaded by ``init()``).
"""

from __future__ import annotations

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
from ._device_pinning import GpuUnavailableError, check_use_gpu, pin_gpu
from ._elastic import ElasticDriver, forget_job
from ._elastic_policy import ElasticPolicy, Workers
from ._iface import NICS_ENV_VARS, nic_names, nics_env
from ._pickling import dumps_with_user_code
from ._rendezvous import worker_env
from ._state import backend_name, data_plane
from ._store_server import hosted_store, start_store_server, stop_store_server
from ._topology import host_major_order
from ._wire import bound_silence

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
    "start_store_server",
    "stop_store_server",
    "verify",
    "worker_env",
]
