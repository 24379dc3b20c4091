"""The import rules of DESIGN.md: who may import whom, and what ``import ringcore`` pulls in."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# package -> top-level modules it must never import (anywhere in its files)
FORBIDDEN = {
    "ringcore": {"pyspark", "ray", "estimators", "spark_runner", "ray_runner", "tensorflow"},
    "spark_runner": {"ray", "ray_runner", "estimators"},
    "ray_runner": {"pyspark", "estimators", "spark_runner"},
    "estimators": {"ray", "ray_runner"},
}
# ringcore's framework bindings may import their own framework
ALLOWED = {("ringcore", "tensorflow"): ("ringcore/tensorflow", "ringcore/keras")}


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_never_imports_what_design_forbids(package):
    offenders = []
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for bad in _imports(path) & FORBIDDEN[package]:
            if any(rel.startswith(p) for p in ALLOWED.get((package, bad), ())):
                continue
            offenders.append(f"{rel} imports {bad}")
    assert offenders == []


def test_import_ringcore_pulls_in_no_engine_and_no_framework():
    code = (
        "import sys, json, ringcore, ringcore.testing, ringcore.data\n"
        "print(json.dumps(sorted(m for m in ('pyspark', 'ray', 'petastorm', 'tensorflow', 'torch') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
