"""spark_runner: launch ringtrain workers as one Spark barrier stage.

``run(fn, num_proc=N)`` runs ``fn`` on N Spark tasks that form one ring; inside,
``ringcore.init()`` needs no settings. Worker output reaches the driver live, each
line prefixed ``[rank]<stdout>:``; when Spark may retry, a failed stage reruns as a
whole and ``RING_SPARK_ATTEMPT`` tells ``fn`` which attempt it is (to resume from a
checkpoint). ``run_elastic(fn, min_num_proc=..., max_num_proc=...)`` keeps a
``ringcore.torch.elastic`` job going as tasks are lost or added (the driver is the
rendezvous coordinator). On a Spark Connect session ``run`` uses
``mapInArrow(..., barrier=True)`` and returns results in chunks, and ``run_elastic`` runs
each worker as a one-task ``mapInArrow`` job (the client is the coordinator).
``local_session()`` builds a SparkSession set up for this machine (tests,
scripts, the demo). ``is_connect(spark)`` tells a Spark Connect session from a classic one.
``wait_for_slots(spark, num_proc, timeout_s)`` (a SparkSession, classic or Connect, or a
SparkContext) fails before any job when the cluster cannot hold ``num_proc`` barrier tasks;
``default_num_proc(spark)`` is the ``num_proc`` that ``run`` uses when none is given.
``progress(step=..., total=..., loss=...)`` inside ``fn`` drives the driver's progress bar
(rank 0's reports, over the output connection).

Any ``torch.distributed`` program runs unchanged: every task has torchrun's ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...; ``run("train.py", args=[...])``
runs a Python file on every task as torchrun would; ``TorchDistributor`` is PySpark's
``TorchDistributor`` (same constructor and ``run``) launched this way.
"""

from ringcore.launch import report_progress as progress

from ._distributor import TorchDistributor
from ._elastic import run_elastic
from ._platform import DEFAULT_START_TIMEOUT_S
from ._run import START_TIMEOUT_ENV_VAR, TOPOLOGY_HOSTS_ENV_VAR, run
from ._session import is_connect, local_session
from ._slots import NotEnoughSlotsError, default_num_proc, wait_for_slots
from ._task import ATTEMPT_ENV_VAR, GPU_ADDRESSES_ENV_VAR

__all__ = [
    "ATTEMPT_ENV_VAR",
    "DEFAULT_START_TIMEOUT_S",
    "GPU_ADDRESSES_ENV_VAR",
    "START_TIMEOUT_ENV_VAR",
    "TOPOLOGY_HOSTS_ENV_VAR",
    "NotEnoughSlotsError",
    "TorchDistributor",
    "default_num_proc",
    "is_connect",
    "local_session",
    "progress",
    "run",
    "run_elastic",
    "wait_for_slots",
]
