"""Files a reader can hold: no module of a package over 500 lines (most under ~400)."""

from __future__ import annotations

import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
MAX_LINES = 500

# the packages held to it (one line per package)
PACKAGES = [
    "ringcore",
    "spark_runner",
    "ray_runner",
    "estimators",
]


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_of_the_package_is_over_500_lines(package):
    long = {
        path.relative_to(ROOT).as_posix(): n
        for path in sorted((ROOT / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}, f"split these by job (at most {MAX_LINES} lines each): {long}"
