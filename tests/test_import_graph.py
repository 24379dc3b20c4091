"""No import circle inside a package, not even one closed by an import inside a function.

Each package's import graph is read from its sources with ``ast``: every ``import`` and
``from ... import`` anywhere in a file — at the top, inside a function, under
``if TYPE_CHECKING:`` — with relative imports resolved. ``from pkg import name`` is an
edge to the module ``pkg.name`` when there is one, else to ``pkg`` (its ``__init__``);
``import a.b`` is an edge to ``a.b`` alone (the packages above it run first, but they do
not depend on it). A circle is named file by file, so the fix can start at its cause.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# the packages whose import graph must have no circle (one line per package)
PACKAGES = [
    "ringcore",
    "spark_runner",
    "ray_runner",
    "estimators",
]


def _modules(package: str, root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of ``package``, by dotted name (a package by its own name)."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module a ``from`` import names (``from ..x import y`` -> ``a.x``)."""
    if not node.level:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    if node.level > 1:
        base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _known(name: str, modules: dict[str, pathlib.Path]) -> str | None:
    """``name`` or the longest of its prefixes that is a module of the package."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in modules:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(package: str, root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of the same package it imports, anywhere in its file."""
    modules = _modules(package, root)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for module, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in modules else base)
            for target in targets:
                found = _known(target, modules)
                if found is not None:
                    graph[module].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that comes back to its start) through each strongly connected
    group of modules, found with Tarjan's algorithm; [] when the graph has none."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1 or v in graph[v]:
                groups.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_circle_in(graph, set(group)) for group in groups]


def _circle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """A shortest path from the group's first module back to itself, inside the group."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return [*paths[v], start]
                if w not in paths:
                    paths[w] = [*paths[v], w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no circle through {start}")  # a strongly connected group has one


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
