"""No import circle inside a package, not even one closed by an import inside a function.

Each package's import graph is read from its sources by ``tools/imports.py``: every
``import`` and ``from ... import`` anywhere in a file — at the top, inside a function,
under ``if TYPE_CHECKING:`` — with relative imports resolved. A circle is named file by
file, so the fix can start at its cause.
"""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("imports", ROOT / "tools" / "imports.py")
_imports = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_imports)
import_graph, circles = _imports.import_graph, _imports.circles

# the packages whose import graph must have no circle: every top-level package
PACKAGES = _imports.PACKAGES


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circle_inside_the_package(package):
    found = [" -> ".join(c) for c in circles(import_graph(package))]
    assert found == [], "import circles (break each at its cause):\n" + "\n".join(found)


def test_the_graph_sees_imports_inside_functions_and_type_checking_and_names_the_circle(
    tmp_path,
):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from .sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..c import X\n"
    )
    (pkg / "c.py").write_text("import pkg.a as a\nfrom pkg import sub\n")
    graph = import_graph("pkg", tmp_path)
    assert graph["pkg.a"] == {"pkg.sub.b"} and graph["pkg.sub.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.a", "pkg.sub"}
    assert circles(graph) == [["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]]
    (pkg / "a.py").write_text("")
    assert circles(import_graph("pkg", tmp_path)) == []


def test_no_import_circle_between_the_packages():
    found = [" -> ".join(c) for c in circles(import_graph(PACKAGES))]
    assert found == [], "import circles across packages:\n" + "\n".join(found)
