"""bench/reliability_report.py: rows from the JUnit XML, and rows that did not run."""

from __future__ import annotations

import importlib.util
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location(
    "reliability_report", ROOT / "bench" / "reliability_report.py"
)
assert _spec is not None and _spec.loader is not None
report = importlib.util.module_from_spec(_spec)
sys.modules["reliability_report"] = report  # its dataclasses look their module up
_spec.loader.exec_module(report)

_XML = """<testsuites><testsuite>
<testcase classname="tests.test_x" name="test_a" time="1.5"><properties>
<property name="reliability.marker.fault" value="a rank killed"/>
<property name="reliability.marker.category" value="fault"/>
<property name="reliability.detect_s" value="0.25"/>
</properties></testcase>
</testsuite></testsuites>"""


def test_a_declared_row_whose_tests_did_not_run_is_shown_missing_not_dropped(tmp_path):
    xml = tmp_path / "r.xml"
    xml.write_text(_XML)
    cases = report.read_cases(str(xml))
    text = report.render(cases, "r.xml", {("fault", "a rank killed"), ("fault", "a host lost")})
    assert "| fault | a rank killed | 1 | pass | 250 ms |" in text
    assert "| fault | a host lost | 0 | **MISSING**" in text
    assert "1 classes not run" in text


def test_the_expected_rows_are_read_from_the_tests_markers():
    rows = report.expected_rows()
    assert ("fault", "a host partitioned from the others (its link down)") in rows
    assert ("security", "malformed pre-auth frames (non-ASCII MAC, nested JSON)") in rows
