"""Horovod's settings object for its Ray executors, as a frozen dataclass.

``RayExecutor.create_settings(...)`` and ``ElasticRayExecutor.create_settings(...)``
return a :class:`RaySettings`; ``RayExecutor(settings, num_workers=...)`` and
``ElasticRayExecutor(settings, ...)`` read it. What maps:

- ``timeout_s``: how long ``ringcore.init()`` on a worker waits for its peers
  (``RING_START_TIMEOUT`` in the workers' environment).
- ``placement_group_timeout_s``: how long ``start()`` waits to place the workers.
- ``nics``: the data-plane interfaces, set in the workers' environment as ``RING_IFACE``,
  ``GLOO_SOCKET_IFNAME`` and ``NCCL_SOCKET_IFNAME`` (comma-joined).
- elastic: ``min_num_proc``, ``max_num_proc``, ``reset_limit``, ``elastic_timeout``.
- ``verbose`` is kept on the settings; ray_runner logs through the ``ringtrain.ray_runner``
  logger whatever its value.

What does not: ``ssh_identity_file`` / ``ssh_str`` / ``ssh_port`` are accepted and
ignored, since the workers are Ray actors that no one logs into (Horovod wrote
``ssh_str`` to the identity file; ringtrain writes nothing).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ringcore.launch import NICS_ENV_VARS, START_TIMEOUT_ENV_VAR, nic_names, nics_env

log = logging.getLogger("ringtrain.ray_runner")

__all__ = ["IFACE_ENV_VARS", "RaySettings", "nics_env", "normalize_nics"]

#: The variables one ``nics`` value sets: ringtrain's own and the ones Gloo and NCCL read.
IFACE_ENV_VARS = NICS_ENV_VARS


def normalize_nics(nics: Any, where: str = "nics") -> tuple[str, ...] | None:
    """``nics`` as a tuple of interface names (a set sorted, a list kept in order)."""
    return None if nics is None else nic_names(nics, where)


def _check_seconds(name: str, value: Any, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise ValueError(f"RaySettings.{name} must be a positive number of seconds, got {value!r}")


def _check_count(name: str, value: Any, low: int, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"RaySettings.{name} must be an integer >= {low} or None, got {value!r}")


@dataclass(frozen=True)
class RaySettings:
    """The settings of a Ray executor (Horovod's ``MiniSettings`` / ``ElasticSettings``).

    Frozen: make a changed copy with ``dataclasses.replace(settings, timeout_s=60)``.
    """

    timeout_s: float = 30
    placement_group_timeout_s: float = 100
    nics: tuple[str, ...] | None = None
    verbose: int = 1
    ssh_identity_file: str | None = None
    min_num_proc: int | None = None
    max_num_proc: int | None = None
    reset_limit: int | None = None
    elastic_timeout: float = 600

    def __post_init__(self) -> None:
        _check_seconds("timeout_s", self.timeout_s)
        _check_seconds("placement_group_timeout_s", self.placement_group_timeout_s)
        _check_seconds("elastic_timeout", self.elastic_timeout)
        object.__setattr__(self, "nics", normalize_nics(self.nics, "RaySettings.nics"))
        if isinstance(self.verbose, bool):
            object.__setattr__(self, "verbose", int(self.verbose))
        if not isinstance(self.verbose, int) or self.verbose < 0:
            raise ValueError(f"RaySettings.verbose must be 0, 1 or 2, got {self.verbose!r}")
        _check_count("min_num_proc", self.min_num_proc, 1)
        _check_count("max_num_proc", self.max_num_proc, 1)
        _check_count("reset_limit", self.reset_limit, 0)
        low, high = self.min_num_proc, self.max_num_proc
        if low is not None and high is not None and high < low:
            raise ValueError(
                f"RaySettings.max_num_proc={high} is below min_num_proc={low}; raise max_num_proc"
            )

    def worker_env(self) -> dict[str, str]:
        """What these settings put into every worker's environment."""
        return {START_TIMEOUT_ENV_VAR: f"{self.timeout_s:g}", **nics_env(self.nics)}


def create_settings(
    timeout_s: float = 30,
    ssh_identity_file: str | None = None,
    ssh_str: str | None = None,
    placement_group_timeout_s: float = 100,
    nics: Any = None,
    verbose: int = 1,
) -> RaySettings:
    """``RayExecutor.create_settings``: Horovod's arguments; the ssh ones are ignored."""
    if ssh_identity_file is not None or ssh_str is not None:
        log.debug("create_settings: ssh_identity_file / ssh_str are ignored (no ssh on Ray)")
    return RaySettings(
        timeout_s=timeout_s,
        placement_group_timeout_s=placement_group_timeout_s,
        nics=nics,
        verbose=verbose,
        ssh_identity_file=ssh_identity_file,
    )


_ELASTIC_EXTRA = ("verbose", "ssh_port", "placement_group_timeout_s")


def create_elastic_settings(
    min_num_proc: int = 1,
    max_num_proc: int | None = None,
    reset_limit: int | None = None,
    elastic_timeout: float = 600,
    timeout_s: float = 30,
    ssh_identity_file: str | None = None,
    nics: Any = None,
    min_np: int | None = None,
    max_np: int | None = None,
    **kwargs: Any,
) -> RaySettings:
    """``ElasticRayExecutor.create_settings``: Horovod's arguments (``min_np`` / ``max_np``
    as deprecated spellings); of Horovod's other settings, ``verbose`` is kept and
    ``ssh_port`` ignored."""
    unknown = sorted(set(kwargs) - set(_ELASTIC_EXTRA))
    if unknown:
        raise TypeError(
            f"ElasticRayExecutor.create_settings got {', '.join(unknown)}, which ringtrain's "
            f"settings do not have; it takes min_num_proc, max_num_proc, reset_limit, "
            f"elastic_timeout, timeout_s, nics, {', '.join(_ELASTIC_EXTRA)} (ssh settings are "
            "ignored: the workers are Ray actors)"
        )
    kwargs.pop("ssh_port", None)
    return RaySettings(
        min_num_proc=min_np if min_np is not None else min_num_proc,
        max_num_proc=max_np if max_np is not None else max_num_proc,
        reset_limit=reset_limit,
        elastic_timeout=elastic_timeout,
        timeout_s=timeout_s,
        ssh_identity_file=ssh_identity_file,
        nics=nics,
        **kwargs,
    )
