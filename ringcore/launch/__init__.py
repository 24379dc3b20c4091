"""What a launcher needs from the core, in one public package: the contract and the kit.

ringcore's runners (spark_runner, ray_runner, the estimators, ringcore.testing) start
ranks in processes of their own and tell each one where it is through environment
variables; this package is the contract between a launcher and ``ringcore.init()``,
and the kit every launcher builds on, so that a new launcher is a small package.

The contract:

- the ``RING_*`` environment names a launcher sets for each rank (topology,
  rendezvous, elastic membership, secrets) and :func:`worker_env`, which builds them
  (:func:`late_worker_env`: a worker started into a running elastic job);
- the job secret (:func:`new_secret`) and the HMAC helpers that authenticate what
  ranks send back to the launcher (:func:`mac`, :func:`verify`, :func:`answer`);
- the key-value store server a launcher may host (:func:`start_store_server`,
  :func:`stop_store_server`, and :func:`hosted_store`: this process's own store);
- rank order and interfaces across hosts (:func:`host_major_order`,
  :func:`nic_names`, :func:`nics_env`; :func:`route_address`, this host's address on
  the route to another, and :func:`interface_addresses`, each interface's);
- the data-plane backend a running job uses (:func:`backend_name`; :func:`data_plane`
  says which path, shared memory or network, carried its ops), and how a
  launcher bounds the silence of a peer on its own sockets (:func:`bound_silence`);
- GPU checks a launcher runs before starting anything (:func:`check_use_gpu`,
  :func:`pin_gpu`, :class:`GpuUnavailableError`);
- the open registry of data-plane backends (:func:`register_backend`: a factory that
  joins the ring and returns a :class:`Connection` holding a :class:`Backend`);
- pickling a user's function with the modules it needs (:func:`dumps_with_user_code`)
  and typed reads of the environment (:func:`get_env`, :func:`get_float`, ...);
- **the torchrun contract**: :func:`torchrun_env` (``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ..., ``MASTER_ADDR``/``MASTER_PORT``: every launcher sets them beside
  the ``RING_*`` ones, so a ``torch.distributed`` program runs unchanged),
  :func:`free_port` (the user's ``MASTER_PORT``, picked on rank 0's host), and the guard
  on ``init_process_group`` a worker installs before the user's code runs
  (:func:`install_init_guard`: one process group per job, whoever forms it first; an
  explicit rank or world size that disagrees with the launcher's is an error) and
  :func:`release_user_group` (a reused worker process starts its next job with no
  group left by the last one);
- **scripts and commands**: :func:`check_script` (a Python file and string arguments,
  checked before any job), :class:`ShippedScript` (the file's bytes sent to the
  workers, run in place or from a copy), :func:`script_command` (the command that runs
  it as ``python PATH ARGS`` would) and :func:`run_command` (runs a command in the
  worker, its output forwarded, its exit status raised as :class:`CommandFailedError`);
  a launched process's group: :func:`die_with_parent`, :func:`signal_group`,
  :func:`end_group`.

The kit:

- **the elastic job loop**: :class:`ElasticJob` owns form -> watch -> re-form -> stop
  over an :class:`ElasticDriver`, which publishes the generations of the ring by one
  :class:`ElasticPolicy` (min and max workers, reset limit, grace period, when to grow
  and when to give up); the launcher supplies only *who is alive* (``(ids, hosts)`` or
  a :class:`Workers`), *start one more*, and how to wait for its workers.
  :func:`check_elastic_limits` checks min/max/reset/timeouts once, in the launcher's own
  parameter names (:class:`ElasticNames`); :func:`forget_job` is for a worker process
  that leaves a job;
- **the worker-error codec**: :func:`signed_blob` / :func:`encode_worker_error` (a
  :class:`~ringcore.WorkerError` pickled and signed with the job's secret),
  :func:`decode_worker_error` (unpickles only blobs this job signed),
  :func:`worker_error_summary` (the short human text), :func:`task_failure_text` (a
  failed worker's side) and :func:`find_worker_error` (the driver's);
- **log forwarding**: :class:`LogServer`, the authenticated line server a launcher
  starts on its driver, and the worker's side: :class:`LogConnection` (or
  :func:`connect_log`), :func:`stream_pair` (stdout/stderr prefixed by rank),
  :func:`report_progress` (rank 0's progress lines); the server drains every
  connection before the launcher prints its end line.

Everything here is stable API between ringtrain's packages; the rooms behind it
(``ringcore.runtime``, ``.engine``, ``.backends``, ...) and the underscore modules are
not, and no other package imports them (tests/project/test_layering.py).
Importing this package imports no framework (torch is loaded by ``init()``).
"""

from __future__ import annotations

from .._auth import answer, job_secret, mac, new_secret, verify
from .._config import (
    AUTOTUNE_ENV_VAR,
    AUTOTUNE_LOG_ENV_VAR,
    CACHE_CAPACITY_ENV_VAR,
    CROSS_RANK_ENV_VAR,
    CROSS_SIZE_ENV_VAR,
    CYCLE_TIME_ENV_VAR,
    DEFAULT_ELASTIC_TIMEOUT_S,
    DEFAULT_START_TIMEOUT_S,
    ELASTIC_ENV_VAR,
    ELASTIC_LATE_ENV_VAR,
    ELASTIC_TIMEOUT_ENV_VAR,
    FUSION_THRESHOLD_ENV_VAR,
    HOSTNAME_ENV_VAR,
    IFACE_ENV_VAR,
    LOCAL_RANK_ENV_VAR,
    LOCAL_SIZE_ENV_VAR,
    LOG_LEVEL_ENV_VAR,
    RANK_ENV_VAR,
    RESET_LIMIT_ENV_VAR,
    SECRET_KEY_ENV_VAR,
    SIZE_ENV_VAR,
    START_TIMEOUT_ENV_VAR,
    STORE_ADDR_ENV_VAR,
    STORE_EXTERNAL_ENV_VAR,
    STORE_PORT_ENV_VAR,
    STORE_PREFIX_ENV_VAR,
    TIMELINE_ENV_VAR,
    TIMELINE_MARK_CYCLES_ENV_VAR,
    WORKER_ID_ENV_VAR,
    get_bool,
    get_env,
    get_float,
    get_int,
)
from .._errors import CommandFailedError, GpuUnavailableError
from ..backends import torch_guard
from ..backends.devices import check_use_gpu
from ..backends.protocol import Backend, Connection
from ..backends.registry import register_backend
from ..backends.torch_guard import release_user_group
from ..elastic.driver import ElasticDriver
from ..elastic.job import ElasticJob, late_worker_env
from ..elastic.limits import ElasticNames, check_elastic_limits
from ..elastic.policy import ElasticPolicy, Workers
from ..elastic.worker import forget_job
from ..engine.wire import bound_silence
from ..rendezvous.environment import TORCHRUN_VARS, free_port, torchrun_env, worker_env
from ..rendezvous.iface import (
    NICS_ENV_VARS,
    interface_addresses,
    nic_names,
    nics_env,
    route_address,
)
from ..rendezvous.store_server import hosted_store, start_store_server, stop_store_server
from ..rendezvous.topology import host_major_order
from ..runtime.state import backend_name, data_plane
from ._commands import (
    TERM_GRACE_S,
    ShippedScript,
    check_script,
    die_with_parent,
    end_group,
    is_script,
    run_command,
    script_command,
    signal_group,
)
from ._gpu import pin_gpu
from ._log_client import LogConnection, connect_log, report_progress, stream_pair
from ._log_server import MAX_HANDSHAKES, MAX_LINE_BYTES, LogServer
from ._user_code import dumps_with_user_code
from ._worker_errors import (
    decode_worker_error,
    encode_worker_error,
    find_worker_error,
    signed_blob,
    task_failure_text,
    worker_error_summary,
)


def install_init_guard() -> None:
    """Guard ``torch.distributed.init_process_group`` in this process (one process group
    per job, whoever forms it first: ``ringcore.backends.torch_guard``), and make the
    backend ``"ring"`` known to the program once it imports ``torch.distributed``
    (``_ring_backend``). Idempotent."""
    from ._ring_backend import know_ring

    torch_guard.install()
    torch_guard.when_imported(know_ring)


__all__ = [
    "AUTOTUNE_ENV_VAR",
    "AUTOTUNE_LOG_ENV_VAR",
    "CACHE_CAPACITY_ENV_VAR",
    "CROSS_RANK_ENV_VAR",
    "CROSS_SIZE_ENV_VAR",
    "CYCLE_TIME_ENV_VAR",
    "DEFAULT_ELASTIC_TIMEOUT_S",
    "DEFAULT_START_TIMEOUT_S",
    "ELASTIC_ENV_VAR",
    "ELASTIC_LATE_ENV_VAR",
    "ELASTIC_TIMEOUT_ENV_VAR",
    "FUSION_THRESHOLD_ENV_VAR",
    "HOSTNAME_ENV_VAR",
    "IFACE_ENV_VAR",
    "LOCAL_RANK_ENV_VAR",
    "LOCAL_SIZE_ENV_VAR",
    "LOG_LEVEL_ENV_VAR",
    "MAX_HANDSHAKES",
    "MAX_LINE_BYTES",
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
    "TERM_GRACE_S",
    "TIMELINE_ENV_VAR",
    "TIMELINE_MARK_CYCLES_ENV_VAR",
    "TORCHRUN_VARS",
    "WORKER_ID_ENV_VAR",
    "Backend",
    "CommandFailedError",
    "Connection",
    "ElasticDriver",
    "ElasticJob",
    "ElasticNames",
    "ElasticPolicy",
    "GpuUnavailableError",
    "LogConnection",
    "LogServer",
    "ShippedScript",
    "Workers",
    "answer",
    "backend_name",
    "bound_silence",
    "check_elastic_limits",
    "check_script",
    "check_use_gpu",
    "connect_log",
    "data_plane",
    "decode_worker_error",
    "die_with_parent",
    "dumps_with_user_code",
    "encode_worker_error",
    "end_group",
    "find_worker_error",
    "forget_job",
    "free_port",
    "get_bool",
    "get_env",
    "get_float",
    "get_int",
    "host_major_order",
    "hosted_store",
    "install_init_guard",
    "interface_addresses",
    "is_script",
    "job_secret",
    "late_worker_env",
    "mac",
    "new_secret",
    "nic_names",
    "nics_env",
    "pin_gpu",
    "register_backend",
    "release_user_group",
    "report_progress",
    "route_address",
    "run_command",
    "script_command",
    "signal_group",
    "signed_blob",
    "start_store_server",
    "stop_store_server",
    "stream_pair",
    "task_failure_text",
    "torchrun_env",
    "verify",
    "worker_env",
    "worker_error_summary",
]
