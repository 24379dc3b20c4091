"""The import rules of docs/architecture.md: who may import whom, and what ``import
ringcore`` pulls in. Between packages only public names travel: no package (nor the
notebooks, bench/ or tools/) imports another package's ``_private`` module; what a
launcher needs from the core is in ``ringcore.launch``."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# package -> top-level modules it must never import (anywhere in its files)
FORBIDDEN = {
    "ringcore": {
        "pyspark",
        "ray",
        "estimators",
        "spark_runner",
        "ray_runner",
        "ringrun",
        "tensorflow",
        "keras",
    },
    "spark_runner": {"ray", "ray_runner", "estimators", "ringrun"},
    "ray_runner": {"pyspark", "estimators", "spark_runner", "ringrun"},
    "estimators": {"ray", "ray_runner", "ringrun"},
    # the launcher is the top: it may use the runners (lazily), never the estimators
    "ringrun": {"estimators"},
}
# ringcore's framework bindings may import their own framework
ALLOWED = {
    ("ringcore", "tensorflow"): ("ringcore/tensorflow", "ringcore/keras"),
    ("ringcore", "keras"): ("ringcore/tensorflow", "ringcore/keras"),
}


def _imports(source: pathlib.Path | ast.AST) -> set[str]:
    """The top-level modules ``source`` (a file, or a syntax tree) imports, anywhere in it."""
    tree = (
        ast.parse(source.read_text(), filename=str(source))
        if isinstance(source, pathlib.Path)
        else source
    )
    names: set[str] = set()
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


# our top-level packages, and the folders whose code may use only their public names
PACKAGES = ("ringcore", "spark_runner", "ray_runner", "estimators", "ringrun")
CLIENTS = ("estimators", "spark_runner", "ray_runner", "ringrun", "notebooks", "bench", "tools")
# (file, private name) pairs allowed, each with its reason; keep this list short
EXCEPTIONS = {
    # the --stages profiler times one op inside the engine's own methods: it wraps the
    # backend the engine holds, which only the engine's state reaches
    ("bench/control_path.py", "ringcore.runtime.state"),
}


# a package's public modules, where its other subpackages are private rooms
# (ringcore.runtime, ringcore.engine, ...: the launchers' door is ringcore.launch)
PUBLIC_MODULES = {
    "ringcore": {"torch", "tensorflow", "keras", "data", "launch", "testing", "progress", "runs"}
}


def _private(dotted: str) -> bool:
    """True when a dotted name goes through an underscore part (``ringcore._config``) or
    into a package's private room (``ringcore.runtime.state``)."""
    parts = dotted.split(".")
    if any(part.startswith("_") and not part.startswith("__") for part in parts):
        return True
    public = PUBLIC_MODULES.get(parts[0])
    return (
        public is not None
        and len(parts) > 1
        and parts[1] not in public
        and (ROOT / parts[0] / parts[1]).is_dir()
    )


def _private_reaches(tree: ast.AST, own: str) -> list[str]:
    """Every import (or attribute access) of another package's private module or name."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            dotted = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            dotted = [f"{node.module}.{a.name}" for a in node.names if a.name != "*"]
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            dotted = [f"{node.value.id}.{node.attr}"]
        else:
            continue
        for name in dotted:
            top = name.split(".")[0]
            if top in PACKAGES and top != own and _private(name):
                found.append(f"line {node.lineno}: {name}")
    return found


def _sources(folder: str):
    """(path, syntax tree) of every Python file and notebook code cell under ``folder``."""
    for path in sorted((ROOT / folder).rglob("*.py")):
        yield path, ast.parse(path.read_text(), filename=str(path))
    for path in sorted((ROOT / folder).rglob("*.ipynb")):
        for cell in json.loads(path.read_text()).get("cells", []):
            if cell.get("cell_type") != "code":
                continue
            lines = cell["source"] if isinstance(cell["source"], list) else [cell["source"]]
            code = "".join(line for line in lines if not line.lstrip().startswith(("%", "!")))
            yield path, ast.parse(code, filename=str(path))


@pytest.mark.parametrize("folder", CLIENTS)
def test_no_code_imports_another_packages_private_modules(folder):
    offenders = []
    for path, tree in _sources(folder):
        rel = path.relative_to(ROOT).as_posix()
        offenders += [
            f"{rel} {hit}"
            for hit in _private_reaches(tree, folder)
            if (rel, hit.split(": ", 1)[1]) not in EXCEPTIONS
        ]
    assert offenders == [], "import the public name (ringcore.launch for launchers) instead"


@pytest.mark.parametrize(
    ("code", "own", "hits"),
    [
        ("from ringcore._config import x", "estimators", 1),
        ("import spark_runner._slots", "estimators", 1),
        ("from ringcore import _config as cfg", "ray_runner", 1),
        ("import ringcore\nringcore._runtime.backend_name()", "bench", 1),
        ("from ringcore.torch._optimizer import x", "tools", 1),
        ("from ringcore.runtime.state import engine", "bench", 1),
        ("from ringcore.engine import engine", "tools", 1),
        ("import ringcore.backends.registry as r", "notebooks", 1),
        ("from ._slots import wait_for_slots", "spark_runner", 0),
        ("from spark_runner._slots import x", "spark_runner", 0),
        ("from ringcore.launch import get_float\nfrom ringcore import __version__", "bench", 0),
        ("from ringcore import init, data\nimport ringcore.torch as hvd", "estimators", 0),
    ],
)
def test_the_private_import_check_sees_every_spelling(code, own, hits):
    assert len(_private_reaches(ast.parse(code), own)) == hits


def test_import_ringcore_pulls_in_no_engine_and_no_framework():
    """torch is the core's tensor type (engine/, backends/, shm/ and the bindings import
    it), but only once a job starts: the public modules a launcher or a driver imports
    load no framework, nor Spark, Ray or Petastorm."""
    code = (
        "import sys, json, ringcore, ringcore.launch, ringcore.testing, ringcore.data\n"
        "print(json.dumps(sorted(m for m in ('pyspark', 'ray', 'petastorm', 'tensorflow', 'torch') if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


# torch is the core's tensor type: the rooms that move tensors import it when they load;
# the others only inside the functions that run once a job starts. dist_backend.py is the
# opt-in torch.distributed backend: importing it registers "ring" with torch.
TORCH_AT_LOAD = ("engine", "backends", "shm", "torch", "tensorflow", "dist_backend.py")


def _imports_torch_at_load(tree: ast.Module) -> bool:
    """True when a module-level statement (not under ``if TYPE_CHECKING:``) imports torch."""
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, ast.If):
            if not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
                pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody
            pending += [stmt for handler in node.handlers for stmt in handler.body]
        elif isinstance(node, ast.Import | ast.ImportFrom) and "torch" in _imports(node):
            return True
    return False


def test_torch_is_imported_on_load_only_by_the_rooms_that_move_tensors():
    loads = sorted(
        path.relative_to(ROOT / "ringcore").as_posix()
        for path in (ROOT / "ringcore").rglob("*.py")
        if _imports_torch_at_load(ast.parse(path.read_text()))
    )
    assert loads and all(p.split("/")[0] in TORCH_AT_LOAD for p in loads), loads
