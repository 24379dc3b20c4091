"""What each task of the barrier stage asks Spark for: ``resources=`` and ``use_gpu``.

:func:`stage_resources` turns ``resources={"gpu": 1, "cpus": 1}`` (per task; ``cpus``
defaults to ``spark.task.cpus``) and ``use_gpu=True`` (one GPU per task) into a
:class:`StagePlan`, before any job runs and without touching CUDA (the GPUs are the
ones Spark knows of, from its resource settings). Where the session's own settings
already give every task that much (``spark.task.cpus``,
``spark.task.resource.gpu.amount``), the stage keeps Spark's default profile. Else the
barrier stage gets a task ResourceProfile (``RDD.withResources``, Spark's stage-level
scheduling: standalone, YARN and Kubernetes, Spark >= 3.4; on Spark Connect,
``mapInArrow(..., profile=)``, pyspark >= 4.0), so the application's other stages keep
every CPU slot. Spark refuses a profile it cannot give (``local[N]``: "TaskResourceProfiles
are only supported for Standalone, Yarn and Kubernetes cluster..."; a GPU amount over
an executor's); then ``use_gpu=True`` alone falls back to pinning each task's GPU by its
local rank (as before ``resources=``), and anything else is refused naming Spark's
reason and the fix. The plan's :meth:`StagePlan.describe` is the log line that says
which was used.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from ringcore import RingError

from ._session import is_connect

#: the per-task keys ``resources=`` takes besides the executors' own custom resources
CPUS, GPU = "cpus", "gpu"


class StageResourcesError(RingError, ValueError):
    """``resources=`` / ``use_gpu`` that are malformed or that the cluster cannot give."""


class ResourceSource(enum.Enum):
    """Where the barrier stage's per-task resources come from."""

    DEFAULT = "Spark's default profile (nothing asked)"
    SESSION_CONF = "the session's settings (spark.task.*)"
    STAGE_PROFILE = "a task ResourceProfile on the barrier stage (stage-level scheduling)"
    LOCAL_RANK = "no GPU from Spark: each task pins the GPU of its local rank"


@dataclass(frozen=True)
class StagePlan:
    """The decision of :func:`stage_resources`: ``request`` is what each task gets
    (empty when nothing was asked), ``profile`` the pyspark ``ResourceProfile`` of a
    :attr:`ResourceSource.STAGE_PROFILE` plan, ``why`` the reason for the choice."""

    source: ResourceSource
    request: dict[str, float] = field(default_factory=dict)
    profile: Any = None
    why: str = ""

    def apply(self, rdd: Any) -> Any:
        """The barrier RDD with this plan's profile (unchanged without one)."""
        return rdd if self.profile is None else rdd.withResources(self.profile)

    def describe_request(self) -> str:
        """What each task asks for, e.g. ``cpus=1, gpu=1``."""
        return _describe(self.request)

    def describe(self) -> str:
        """One log line: what each task asks for, and from where."""
        asked = self.describe_request()
        why = f" ({self.why})" if self.why else ""
        return f"barrier tasks' resources: {asked or 'none asked'} from {self.source.value}{why}"


def _num(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def _show(resources: Mapping[str, Any] | None, use_gpu: bool | None) -> str:
    return f"resources={dict(resources)!r}" if resources else f"use_gpu={use_gpu!r}"


def check_request(
    resources: Mapping[str, Any] | None, use_gpu: bool | None, known: Collection[str] = ()
) -> dict[str, float] | None:
    """The per-task request of ``resources`` and ``use_gpu`` (None: nothing asked), checked
    without the cluster: keys ``cpus``, ``gpu`` or one of ``known`` (the executors' own
    resources), amounts positive, ``cpus`` whole, others whole or a fraction <= 1 (Spark's
    rule); ``use_gpu=True`` adds ``gpu=1``, ``use_gpu=False`` with a GPU amount is refused."""
    if resources is None:
        return {GPU: 1.0} if use_gpu else None
    if not isinstance(resources, Mapping):
        raise TypeError(f"resources must be a dict such as {{'gpu': 1}}, got {resources!r}")
    allowed = {CPUS, GPU} | set(known)
    request: dict[str, float] = {}
    for key, amount in resources.items():
        if key not in allowed:
            raise StageResourcesError(
                f"resources={dict(resources)!r}: unknown resource {key!r}. Per task it takes "
                f"{', '.join(repr(k) for k in sorted(allowed))}, e.g. {{'gpu': 1, 'cpus': 1}}."
            )
        request[key] = _checked_amount(resources, key, amount)
    if use_gpu is False and request.get(GPU):
        raise StageResourcesError(
            f"resources={dict(resources)!r} asks for GPUs but use_gpu=False; drop one of them."
        )
    if use_gpu and GPU not in request:
        request[GPU] = 1.0
    return request


def _checked_amount(resources: Mapping[str, Any], key: str, amount: Any) -> float:
    given = f"resources={dict(resources)!r}"
    if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
        raise StageResourcesError(
            f"{given}: the amount of {key!r} must be a positive number, got {amount!r}; "
            f"ask for e.g. {{{key!r}: 1}}, or leave {key!r} out."
        )
    if key == CPUS and not float(amount).is_integer():
        raise StageResourcesError(f"{given}: 'cpus' must be a whole number, got {amount!r}.")
    if amount > 1 and not float(amount).is_integer():
        raise StageResourcesError(
            f"{given}: {key!r} must be a whole number or a fraction <= 1 (tasks sharing one), "
            f"got {amount!r}."
        )
    return float(amount)


def _conf_getter(spark: Any) -> Callable[[str], str | None]:
    if is_connect(spark):
        return lambda key: spark.conf.get(key, None)
    sc = getattr(spark, "sparkContext", spark)
    return lambda key: sc.getConf().get(key, None)


def _session_resources(spark: Any, role: str) -> dict[str, float]:
    """``spark.<role>.resource.<name>.amount`` of the session, by name (role: task or
    executor)."""
    if is_connect(spark):
        conf = dict(spark.conf.getAll) if hasattr(spark.conf, "getAll") else {}
    else:
        conf = dict(getattr(spark, "sparkContext", spark).getConf().getAll())
    prefix, suffix = f"spark.{role}.resource.", ".amount"
    return {
        k[len(prefix) : -len(suffix)]: float(v)
        for k, v in conf.items()
        if k.startswith(prefix) and k.endswith(suffix)
    }


def stage_resources(
    spark: Any, resources: Mapping[str, Any] | None, use_gpu: bool | None
) -> StagePlan:
    """The :class:`StagePlan` of a barrier stage (see the module docstring). ``spark``: a
    SparkSession (classic or Spark Connect) or a SparkContext. Runs no job; raises
    :class:`StageResourcesError` naming the value and the fix for what the cluster cannot
    give."""
    executors = _session_resources(spark, "executor")
    request = check_request(resources, use_gpu, set(executors))
    if request is None:
        return StagePlan(ResourceSource.DEFAULT)
    get = _conf_getter(spark)
    task_cpus = float(get("spark.task.cpus") or 1)
    request.setdefault(CPUS, task_cpus)
    default = {CPUS: task_cpus, **_session_resources(spark, "task")}
    if all(default.get(k) == v for k, v in request.items()):
        return StagePlan(ResourceSource.SESSION_CONF, request, why="the default profile gives it")
    return _profile_plan(spark, request, resources, use_gpu, default, executors)


def _lacking(request: dict[str, float], executors: dict[str, float]) -> str | None:
    """Why no executor can hold one task of ``request`` (None: each can)."""
    for name, amount in request.items():
        have = executors.get(name, 0.0)
        if name == CPUS or have >= amount:
            continue
        return (
            f"each executor has {_num(have)} {name} (spark.executor.resource.{name}.amount)"
            if have
            else f"the executors have no {name} (spark.executor.resource.{name}.amount is unset)"
        )
    return None


def _build_profile(request: dict[str, float]) -> Any:
    from pyspark.resource import ResourceProfileBuilder, TaskResourceRequests

    requests = TaskResourceRequests().cpus(int(request[CPUS]))
    for name, amount in request.items():
        if name != CPUS:
            requests = requests.resource(name, amount)
    return ResourceProfileBuilder().require(requests).build


def _register(spark: Any, profile: Any) -> None:
    """Have Spark take ``profile`` now, so it refuses one it cannot give before any job."""
    if not is_connect(spark):
        getattr(spark, "sparkContext", spark).parallelize([], 1).withResources(profile)
        return
    from pyspark.sql.connect.dataframe import DataFrame

    if "profile" not in inspect.signature(DataFrame.mapInArrow).parameters:
        raise _Unsupported("this pyspark's Spark Connect client cannot send a ResourceProfile")
    from pyspark.sql.connect.resource.profile import ResourceProfile

    remote = ResourceProfile(profile._executor_resource_requests, profile._task_resource_requests)
    profile._id = remote.id  # the server's id: mapInArrow(profile=) sends it


class _Unsupported(Exception):
    pass


def _spark_reason(exc: BaseException) -> str:
    java = getattr(exc, "java_exception", None)
    if java is not None:
        return str(java.getMessage())
    text = str(exc).strip()
    return text.split("\n: ", 1)[-1].split("\n", 1)[0]


def _profile_plan(
    spark: Any,
    request: dict[str, float],
    resources: Mapping[str, Any] | None,
    use_gpu: bool | None,
    default: dict[str, float],
    executors: dict[str, float],
) -> StagePlan:
    """A task ResourceProfile of ``request`` once Spark took it; else, for ``use_gpu=True``
    alone, the local-rank fallback; else :class:`StageResourcesError`."""
    profile = _build_profile(request)
    reason, unsupported = None, False
    try:
        _register(spark, profile)
    except Exception as exc:  # Py4JJavaError, a Connect error, _Unsupported
        reason = _spark_reason(exc)
        unsupported = isinstance(exc, _Unsupported) or "only supported" in reason
    lacking = None if unsupported else _lacking(request, executors)
    if reason is None and lacking is None:
        return StagePlan(ResourceSource.STAGE_PROFILE, request, profile, "other stages keep theirs")
    why = (lacking or reason or "").rstrip(".")
    if resources is None and use_gpu and request[CPUS] == default[CPUS]:  # use_gpu=True alone
        return StagePlan(ResourceSource.LOCAL_RANK, {CPUS: default[CPUS]}, why=why)
    if unsupported:
        fix = (
            "Run on a standalone, YARN or Kubernetes cluster (Spark >= 3.4) for stage-level "
            "scheduling, or create the session with spark.task.cpus / "
            "spark.task.resource.<name>.amount set to what every task needs"
        )
    elif lacking:
        fix = (
            "Create the session with spark.executor.resource.<name>.amount (and, on "
            "standalone, spark.worker.resource.<name>.amount and its discovery script) "
            "large enough, or ask for less"
        )
    else:
        fix = "Ask for what one executor holds"
    raise StageResourcesError(
        f"{_show(resources, use_gpu)}: Spark cannot give each barrier task {_describe(request)}: "
        f"{why}. The session's settings give each task {_describe(default)}. {fix}."
    )


def _describe(request: dict[str, float]) -> str:
    return ", ".join(f"{k}={_num(v)}" for k, v in sorted(request.items()))
