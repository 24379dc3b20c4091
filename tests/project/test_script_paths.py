"""The scripts that put tests/ on ``sys.path`` (for its helpers) put the project's root
before it: tests/ringcore, tests/spark_runner, ... would else be found as namespace
packages ahead of the real ones, from any folder the script is started in."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("script", ["bench/hierarchical.py", "tools/cluster.py"])
def test_a_script_using_the_tests_helpers_imports_the_real_packages(script, tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / script), "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the root: only the script's own sys.path counts
    )
    assert result.returncode == 0, result.stderr[-2000:]
