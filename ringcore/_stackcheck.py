"""``python -m ringcore._stackcheck``: fail loudly when the installed packages do not
work together (pip does not notice: Petastorm breaks on pyarrow >= 15 and numpy 2)."""

from __future__ import annotations

import importlib.metadata as md
import sys

from ._errors import StackError


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _major_minor(v: str) -> tuple[int, int]:
    parts = v.split(".")
    return int(parts[0]), int(parts[1])


def check() -> list[str]:
    """The problems found; empty when the stack works."""
    problems = []
    if _version("petastorm"):
        pa, np = _version("pyarrow"), _version("numpy")
        if pa and _major_minor(pa) >= (15, 0):
            problems.append(
                f"petastorm needs pyarrow < 15, found {pa}: pip install 'pyarrow<15' or use reader='arrow'"
            )
        if np and _major_minor(np) >= (2, 0):
            problems.append(
                f"petastorm needs numpy < 2, found {np}: pip install 'numpy<2' or use reader='arrow'"
            )
    return problems


def main() -> int:
    problems = check()
    for p in problems:
        print(f"stack check: {p}", file=sys.stderr)
    if problems:
        raise StackError("; ".join(problems))
    print(
        "stack check: ok ("
        + ", ".join(
            f"{n} {_version(n)}"
            for n in ("torch", "pyspark", "ray", "pyarrow", "numpy", "petastorm")
            if _version(n)
        )
        + ")"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
