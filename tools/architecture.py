"""Draw docs/architecture.md's two import diagrams from the code.

``python tools/architecture.py`` rewrites the blocks between ``<!-- generated:NAME -->``
and ``<!-- end generated -->`` in docs/architecture.md; ``--check`` only says whether
they are current (exit 1 when not). ``tests/project/test_architecture_diagrams.py`` fails when
the document drifts from the code.

- ``packages``: who imports whom between ringtrain's packages; ringcore is drawn as the
  public modules the other packages import (its doors).
- ``rooms``: the rooms of ringcore (its subpackages and public modules; the underscore
  modules at its top are one node, "leaves"). An arrow is a direct import; an arrow
  that a longer path already implies is left out (the transitive reduction), so the
  drawing stays readable; the graph has no circle (``tests/project/test_import_graph.py``).
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from imports import PACKAGES, ROOT, circles, collapse, import_graph

DOC = ROOT / "docs" / "architecture.md"
_BLOCK = re.compile(r"(<!-- generated:(\w+) -->\n)(.*?)(<!-- end generated -->)", re.S)


def _door(module: str) -> str:
    """A module's unit in the package diagram: its package, or ringcore's public door."""
    parts = module.split(".")
    if parts[0] != "ringcore" or len(parts) == 1:
        return parts[0]
    return "ringcore" if parts[1].startswith("_") else f"ringcore.{parts[1]}"


def _room(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "ringcore":
        return None
    if len(parts) == 1:
        return "ringcore"
    return "leaves" if parts[1].startswith("_") else parts[1]


def _node(name: str) -> str:
    return name.replace(".", "_")


def _reduce(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The transitive reduction of an acyclic graph: drop a -> c when a -> ... -> c."""

    def reach(v: str, seen: set[str]) -> set[str]:
        for w in graph[v]:
            if w not in seen:
                seen.add(w)
                reach(w, seen)
        return seen

    out = {}
    for v, targets in graph.items():
        implied = set().union(*(reach(w, set()) for w in targets)) if targets else set()
        out[v] = {w for w in targets if w not in implied}
    return out


def packages_diagram() -> str:
    graph = collapse(import_graph(PACKAGES), _door)
    doors = sorted(
        {w for v, ws in graph.items() if not v.startswith("ringcore") for w in ws}
        - set(PACKAGES[:-1])
    )
    lines = ["flowchart TB"]
    for package in PACKAGES[:-1]:
        lines.append(f'    {_node(package)}["{package}/"]')
    lines.append('    subgraph core["ringcore/ (the modules other packages import)"]')
    lines += [f'        {_node(d)}["{d}"]' for d in doors]
    lines.append("    end")
    for v in PACKAGES[:-1]:
        lines += [f"    {_node(v)} --> {_node(w)}" for w in sorted(graph.get(v, ()))]
    return "\n".join(lines)


def rooms_diagram() -> str:
    graph = collapse(import_graph(["ringcore"]), _room)
    if circles(graph):
        raise SystemExit(f"ringcore's rooms import each other in a circle: {circles(graph)}")
    lines = ["flowchart TB"]
    lines += [f'    {_node(v)}["{v}"]' for v in sorted(graph)]
    for v, targets in sorted(_reduce(graph).items()):
        lines += [f"    {_node(v)} --> {_node(w)}" for w in sorted(targets)]
    return "\n".join(lines)


DIAGRAMS = {"packages": packages_diagram, "rooms": rooms_diagram}


def rendered(text: str) -> str:
    """``text`` with every generated block redrawn from the code."""

    def redraw(m: re.Match) -> str:
        name = m.group(2)
        if name not in DIAGRAMS:
            raise SystemExit(f"docs/architecture.md names an unknown diagram {name!r}")
        return f"{m.group(1)}```mermaid\n{DIAGRAMS[name]()}\n```\n{m.group(4)}"

    return _BLOCK.sub(redraw, text)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the doc drifted")
    args = parser.parse_args()
    text = DOC.read_text()
    new = rendered(text)
    if args.check:
        if new != text:
            print("docs/architecture.md's diagrams drifted: run python tools/architecture.py")
            return 1
        return 0
    DOC.write_text(new)
    print(f"wrote {DOC.relative_to(ROOT)} ({len(_BLOCK.findall(new))} diagrams)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
