"""Reliability tests: how to mark them, how to record what they measured.

Every test that belongs in RELIABILITY.md (a fault injected, bad input rejected, a rogue
peer refused, a load survived) carries the ``reliability`` marker::

    import pytest
    from _reliability import record

    @pytest.mark.reliability(fault="a rank SIGKILLed inside an allreduce", category="fault")
    @pytest.mark.timeout(90)
    def test_a_rank_killed_inside_an_allreduce_fails_the_others(request):
        elapsed = ...  # what the test measured
        record(request, detect_s=elapsed)  # shows up as "time to detect" in RELIABILITY.md

Marker keywords (``fault`` and ``category`` are required):

- ``fault``: the class of fault / bad input, in words. Tests with the same ``fault``
  string are one row of the table (their cases add up).
- ``category``: one of ``fault``, ``bad-input``, ``security``, ``load``.
- ``cases`` (default 1): how many cases this test tries — e.g. a table-driven test of
  30 bad inputs in one function says ``cases=30``. A parametrized test counts each
  parameter as one test, so leave ``cases`` at 1 there.

``record(request, **measures)`` stores numbers a test measured on the test's report
(``request.node.user_properties``, which ``--junitxml`` writes as ``<property>``). The
report knows these keys: ``detect_s`` (seconds from the fault to its detection: the
error raised, the peer refused), ``recover_s`` (seconds from the fault until the job
ran on again), ``cases`` (overrides the marker, when a test learns its count at run
time) and ``note`` (a short text, e.g. "RSS grew 3 MiB"). Other keys are kept and
listed as-is. It works in any run; it costs nothing outside ``make reliability``.

``make reliability`` runs ``pytest -m reliability -p _reliability --junitxml=...`` (this
module, loaded as a plugin, copies each test's marker keywords into its XML
properties) and ``bench/reliability_report.py`` turns the XML into RELIABILITY.md.
Import this module as ``from _reliability import record`` (pytest puts ``tests/`` on
``sys.path``; ``make reliability`` sets ``PYTHONPATH=<root>:tests``: the project's root
first, or a Python that the tests start would find the test folders ``tests/ringcore``,
``tests/spark_runner``, ... as namespace packages before the real ones).
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["CATEGORIES", "KNOWN_MEASURES", "record"]

CATEGORIES = ("fault", "bad-input", "security", "load")
KNOWN_MEASURES = ("detect_s", "recover_s", "cases", "note")
PROPERTY_PREFIX = "reliability."


def record(request: Any, **measures: Any) -> None:
    """Record measured numbers (``detect_s=1.2``, ``recover_s=..``, ``note=".."``) for the report."""
    for key, value in measures.items():
        if value is None:
            continue
        if key.endswith("_s"):
            value = f"{float(value):.3f}"
        request.node.user_properties.append((PROPERTY_PREFIX + key, str(value)))


# -- the plugin half (``-p _reliability``) ----------------------------------------------


def _marker_properties(marker: Any, nodeid: str) -> list[tuple[str, str]]:
    kw = dict(marker.kwargs)
    missing = [k for k in ("fault", "category") if not kw.get(k)]
    if missing:
        raise pytest.UsageError(
            f"{nodeid}: @pytest.mark.reliability needs {missing}; e.g. "
            '@pytest.mark.reliability(fault="a rank killed", category="fault")'
        )
    if kw["category"] not in CATEGORIES:
        raise pytest.UsageError(
            f"{nodeid}: reliability category={kw['category']!r} is not one of {CATEGORIES}"
        )
    kw.setdefault("cases", 1)
    return [(PROPERTY_PREFIX + "marker." + k, str(v)) for k, v in kw.items()]


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    marker = item.get_closest_marker("reliability")
    if marker is not None:
        item.user_properties.extend(_marker_properties(marker, item.nodeid))
