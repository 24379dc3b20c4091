"""RELIABILITY.md from the JUnit XML of the reliability tests (``make reliability``).

Usage: ``python bench/reliability_report.py REPORT.xml [MORE.xml ...] RELIABILITY.md``

Every test marked ``@pytest.mark.reliability(fault=..., category=...)`` (see
``tests/_reliability.py``) carries its marker keywords and what it measured as JUnit
``<property>`` elements; this script groups the tests by fault class and writes one
table row per class: cases tried, what happened, time to detect / recover. It exits 1
when a test failed (after writing the file, so the table shows the failure) and 2 when
the XML holds no reliability test at all.
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import os
import pathlib
import platform
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field

PREFIX = "reliability."
TESTS = pathlib.Path(__file__).resolve().parents[1] / "tests"
CATEGORY_ORDER = ("fault", "bad-input", "security", "load")


@dataclass
class Case:
    test: str
    outcome: str  # passed | failed | error | skipped
    seconds: float
    props: dict[str, str] = field(default_factory=dict)

    @property
    def cases(self) -> int:
        raw = self.props.get("cases") or self.props.get("marker.cases") or "1"
        try:
            return int(raw)
        except ValueError:
            return 1


def read_cases(path: str) -> list[Case]:
    out = []
    for tc in ET.parse(path).getroot().iter("testcase"):
        props = {
            p.get("name", "")[len(PREFIX) :]: p.get("value", "")
            for p in tc.iter("property")
            if p.get("name", "").startswith(PREFIX)
        }
        if "marker.fault" not in props:
            continue
        outcome = "passed"
        for tag in ("failure", "error", "skipped"):
            if tc.find(tag) is not None:
                outcome = {"failure": "failed"}.get(tag, tag)
        name = f"{tc.get('classname', '')}::{tc.get('name', '')}"
        out.append(Case(name, outcome, float(tc.get("time") or 0.0), props))
    return out


def expected_rows(tests: pathlib.Path = TESTS) -> set[tuple[str, str]]:
    """Every (category, fault) some test declares with ``@pytest.mark.reliability``, read
    from the sources: a row whose tests did not run (a module skipped at collection,
    say) is then shown as missing instead of silently dropped."""
    rows = set()
    for path in sorted(tests.rglob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr != "reliability":
                continue
            kw = {k.arg: k.value for k in node.keywords}
            fault, category = kw.get("fault"), kw.get("category")
            if isinstance(fault, ast.Constant) and isinstance(category, ast.Constant):
                rows.add((str(category.value), str(fault.value)))
    return rows


def _one(v: float) -> str:
    return f"{v * 1000:.0f} ms" if v < 1 else f"{v:.1f} s"


def _seconds(values: list[float]) -> str:
    if not values:
        return "n/a"
    lo, hi = min(values), max(values)
    return _one(hi) if _one(lo) == _one(hi) else f"{_one(lo)} to {_one(hi)}"


def _result(cases: list[Case]) -> str:
    counts: dict[str, int] = defaultdict(int)
    for c in cases:
        counts[c.outcome] += 1
    if counts.keys() == {"passed"}:
        return "pass"
    parts = [f"{n} {k}" for k, n in sorted(counts.items())]
    return ("**FAIL** " if counts["failed"] or counts["error"] else "") + ", ".join(parts)


def _floats(cases: list[Case], key: str) -> list[float]:
    vals = []
    for c in cases:
        with contextlib.suppress(KeyError, ValueError):
            vals.append(float(c.props[key]))
    return vals


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _notes(notes: list[str]) -> str:
    """Distinct notes in first-seen order; a note repeated by many cases once, with its count."""
    counts: dict[str, int] = {}
    for note in notes:
        counts[note] = counts.get(note, 0) + 1
    return "; ".join(n if k == 1 else f"{n} (x{k})" for n, k in counts.items())


def render(cases: list[Case], source: str, expected: set[tuple[str, str]] | None = None) -> str:
    rows: dict[tuple[str, str], list[Case]] = defaultdict(list)
    for c in cases:
        rows[(c.props["marker.category"], c.props["marker.fault"])].append(c)
    missing = sorted((expected or set()) - set(rows))
    for key in missing:
        rows[key] = []
    order = sorted(
        rows,
        key=lambda k: (CATEGORY_ORDER.index(k[0]) if k[0] in CATEGORY_ORDER else 9, k[1]),
    )
    failed = sum(c.outcome in ("failed", "error") for c in cases)
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# Reliability",
        "",
        "Faults injected, bad input fed, rogue peers let loose and loads run by the tests",
        "marked `@pytest.mark.reliability` (see `tests/_reliability.py`), and what happened.",
        f"Generated by `make reliability` from {source} on {now}, commit {_git_commit()},",
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python "
        f"{platform.python_version()}. Do not edit by hand.",
        "",
        f"**{len(rows)} fault classes, {sum(c.cases for c in cases)} cases in {len(cases)} "
        f"tests: {len(cases) - failed} passed, {failed} failed"
        + (f"; {len(missing)} classes not run (shown as missing)" if missing else "")
        + ".**",
        "",
        "*Detect*: seconds from the fault to its detection (the error raised on the other "
        "ranks, the peer refused), as the test measured it. *Recover*: seconds until the job "
        "ran on (or the op completed) after the fault. n/a: not measured by that test.",
        "",
        "| category | fault / bad input | cases | result | detect | recover | notes |",
        "|---|---|---:|---|---|---|---|",
    ]
    for key in order:
        group = rows[key]
        if not group:
            lines.append(
                f"| {key[0]} | {key[1]} | 0 | **MISSING**: no test of this class ran "
                "(skipped at collection or deselected) | n/a | n/a |  |"
            )
            continue
        notes = _notes([c.props["note"] for c in group if c.props.get("note")])
        lines.append(
            f"| {key[0]} | {key[1]} | {sum(c.cases for c in group)} | {_result(group)} | "
            f"{_seconds(_floats(group, 'detect_s'))} | {_seconds(_floats(group, 'recover_s'))} "
            f"| {notes.replace('|', '/')} |"
        )
    lines += ["", "## Tests", "", "| test | fault | result | wall |", "|---|---|---|---:|"]
    for c in sorted(cases, key=lambda c: c.test):
        lines.append(
            f"| `{c.test}` | {c.props['marker.fault']} | {c.outcome} | {c.seconds:.1f} s |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    xml_paths, md_path = argv[1:-1], argv[-1]
    cases = [c for path in xml_paths for c in read_cases(path)]
    if not cases:
        print(f"{xml_paths} hold no test marked @pytest.mark.reliability", file=sys.stderr)
        return 2
    with open(md_path, "w", encoding="utf-8") as f:
        f.write(render(cases, ", ".join(f"`{p}`" for p in xml_paths), expected_rows()))
    failed = [c.test for c in cases if c.outcome in ("failed", "error")]
    print(f"wrote {md_path}: {len(cases)} tests, {len(failed)} failed")
    for name in failed:
        print(f"  FAILED {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
