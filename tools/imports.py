"""The import graph of ringtrain's packages, read from their sources with ``ast``.

Every ``import`` and ``from ... import`` anywhere in a file counts — at the top, inside
a function, under ``if TYPE_CHECKING:`` — with relative imports resolved. ``from pkg
import name`` is an edge to the module ``pkg.name`` when there is one, else to ``pkg``
(its ``__init__``); ``import a.b`` is an edge to ``a.b`` alone (the packages above it
run first, but they do not depend on it).

Used by ``tests/project/test_import_graph.py`` (no circle in any package) and
``tools/architecture.py`` (the package diagrams of docs/architecture.md).
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# ringtrain's top-level packages, in the order the diagrams draw them
PACKAGES = ["ringrun", "estimators", "spark_runner", "ray_runner", "ringcore"]


def modules(packages: list[str], root: pathlib.Path = ROOT) -> dict[str, pathlib.Path]:
    """Every module of ``packages``, by dotted name (a package by its own name)."""
    out = {}
    for package in packages:
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


def _known(name: str, known: dict[str, pathlib.Path]) -> str | None:
    """``name`` or the longest of its prefixes that is a known module."""
    parts = name.split(".")
    while parts:
        if ".".join(parts) in known:
            return ".".join(parts)
        parts.pop()
    return None


def import_graph(packages: str | list[str], root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of ``packages`` it imports, anywhere in its file."""
    known = modules([packages] if isinstance(packages, str) else packages, root)
    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = _resolve(module, is_package, node)
                for a in node.names:
                    sub = f"{base}.{a.name}"
                    targets.append(sub if sub in known else base)
            for target in targets:
                found = _known(target, known)
                if found is not None and found != module:
                    graph[module].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle (a path that comes back to its start) through each strongly connected
    group of nodes, found with Tarjan's algorithm; [] when the graph has none."""
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
    """A shortest path from the group's first node back to itself, inside the group."""
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


def collapse(graph: dict[str, set[str]], unit) -> dict[str, set[str]]:
    """The graph between units (``unit(module)`` names a module's unit, or None to leave
    it out), without a unit's edges to itself."""
    out: dict[str, set[str]] = {}
    for module, targets in graph.items():
        a = unit(module)
        if a is None:
            continue
        out.setdefault(a, set())
        for target in targets:
            b = unit(target)
            if b is not None and b != a:
                out[a].add(b)
                out.setdefault(b, set())
    return out
