"""The limits of an elastic job, checked once for every launcher.

Each launcher names the same four limits its own way — ``min_num_proc`` for
``spark_runner.run_elastic``, ``min_workers`` for ray_runner, ``min_np`` for
``ringcore.testing.run_workers``, the fields for :class:`~.policy.ElasticPolicy` — so
:func:`check_elastic_limits` takes those names (:class:`ElasticNames`) and every message
says the name the user typed, the value seen and what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ElasticNames", "check_elastic_limits"]


@dataclass(frozen=True)
class ElasticNames:
    """What a launcher calls each limit, for its messages (``owner``: a prefix such as
    ``"ElasticPolicy."`` for the name being checked; the others are named bare)."""

    min: str = "min_workers"
    max: str = "max_workers"
    num: str = "num_workers"
    reset_limit: str = "reset_limit"
    timeout: str = "elastic_timeout"
    owner: str = ""
    max_none: str = "None"  # what ``max=None`` means to this launcher's user


def _at_least(value: object, low: int) -> bool:
    """``value`` is an integer (not a bool) ``>= low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def check_elastic_limits(
    min_workers: object,
    max_workers: object = None,
    reset_limit: object = None,
    timeout_s: object = None,
    *,
    num: object = None,
    min_required: bool = True,
    names: ElasticNames = ElasticNames(),
) -> None:
    """Raise ``ValueError`` unless ``1 <= min_workers <= num <= max_workers`` (integers;
    ``num`` None: not given; ``max_workers`` None: no bound, or ``num``; ``min_workers``
    None, where not ``min_required``: ``num``), ``reset_limit`` is None or an integer
    ``>= 0`` and ``timeout_s`` None or seconds ``> 0``. Called once, before any job
    starts, with what the user passed."""
    n = names
    if (min_workers is not None or min_required) and not _at_least(min_workers, 1):
        raise ValueError(f"{n.owner}{n.min} must be an integer >= 1, got {min_workers!r}")
    floor = 1 if min_workers is None else int(min_workers)  # type: ignore[call-overload]
    if max_workers is not None and not _at_least(max_workers, floor):
        named = "1" if min_workers is None else f"{n.min}={min_workers}"
        raise ValueError(
            f"{n.owner}{n.max} must be {n.max_none} or an integer >= {named}, got {max_workers!r}"
        )
    if num is not None:
        if not _at_least(num, 1):
            raise ValueError(f"{n.owner}{n.num} must be an integer >= 1, got {num!r}")
        count = int(num)  # type: ignore[call-overload]
        low = count if min_workers is None else floor
        high = count if max_workers is None else int(max_workers)  # type: ignore[call-overload]
        if not low <= count <= high:
            raise ValueError(
                f"need {n.min} <= {n.num} <= {n.max}, got {low} <= {count} <= {high}; "
                f"{n.num} is how many workers form the first ring."
            )
    if reset_limit is not None and not _at_least(reset_limit, 0):
        raise ValueError(
            f"{n.owner}{n.reset_limit} must be None or an integer >= 0, got {reset_limit!r}"
        )
    if timeout_s is not None and (
        isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or timeout_s <= 0
    ):
        raise ValueError(f"{n.owner}{n.timeout} must be > 0 seconds, got {timeout_s!r}")
