"""tools/examples.py and tools/conformance.py share docs/conformance.md: each rewrites
its own part of the page and keeps the other's; a failed example is reported by the
line it failed on (not a peer's "lost a rank" echo); every measured reason names an
example of the table. Pure functions only: running the examples is the tool's job."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

TOOLS = Path(__file__).resolve().parents[2] / "tools"


MODULES = ("examples", "example_table", "conformance", "horovod_shim")


@pytest.fixture(scope="module")
def tools():
    sys.path.insert(0, str(TOOLS))
    try:
        yield {name: importlib.import_module(name) for name in MODULES}
    finally:
        sys.path.remove(str(TOOLS))
        for name in MODULES:
            sys.modules.pop(name, None)


def _suite_outcome(conformance, result="passed"):
    return conformance.Outcome("test_torch.py", "test_torch.py::T::test_a", result, "", 1.0)


def _example_result(examples, result="passed"):
    return examples.Result(
        "pytorch/pytorch_mnist.py", "horovodrun", ["--epochs", "1"], result, "", 2.0
    )


META = {"np": "2", "horovod_commit": "abc", "ringtrain_commit": "def", "date": "2026-12-06"}
META.update(torch="2", tensorflow="2", keras="3")


def test_each_tool_rewrites_its_part_of_the_conformance_page_and_keeps_the_other(tools, tmp_path):
    examples, conformance = tools["examples"], tools["conformance"]
    page = tmp_path / "conformance.md"
    conformance.write_markdown(page, [_suite_outcome(conformance)], META)
    examples.write_section(page, [_example_result(examples)], META)
    assert "| test_torch.py | 1 | 1 |" in page.read_text()
    assert "`pytorch/pytorch_mnist.py` | horovodrun | `--epochs 1`" in page.read_text()
    # the suites rerun: their table changes, the examples' section stays
    conformance.write_markdown(page, [_suite_outcome(conformance, "failed")], META)
    text = page.read_text()
    assert "| test_torch.py | 1 | 0 | 1 |" in text
    assert text.count(examples.BEGIN) == 1 and "1 examples: 1 passed" in text
    # the examples rerun: their section is replaced in place, the suites' part stays
    examples.write_section(page, [_example_result(examples, "hang")], META)
    text = page.read_text()
    assert text.count(examples.BEGIN) == 1 and "1 examples: 1 hang" in text
    assert "| test_torch.py | 1 | 0 | 1 |" in text


def test_the_error_of_a_failed_example_is_its_own_innermost_exception_line(tools):
    error_line = tools["examples"].error_line
    output = "\n".join(
        [
            "[rank0]: Traceback (most recent call last):",
            "[rank0]: TypeError: in user code:",
            "[rank0]:     TypeError: 'list' object is not callable",
            "ringcore._errors.RingInternalError: rank 1 left the ring",
        ]
    )
    assert error_line(output) == "TypeError: 'list' object is not callable"
    assert error_line("just a last line\n\n") == "just a last line"


def test_every_measured_reason_names_an_example_of_the_table(tools):
    table = tools["example_table"]
    paths = {e.path for e in table.EXAMPLES}
    assert len(paths) == len(table.EXAMPLES)  # no example twice
    assert set(table.KNOWN) <= paths
    assert all(k.kind in ("not ours", "not runnable here") for k in table.KNOWN.values())
