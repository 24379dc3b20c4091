"""Every ```python block of README.md and docs/*.md runs, so the docs cannot rot.

The blocks of one file run in order in one namespace (as a reader pastes them into
one session), in a fresh interpreter per file with a temporary working directory;
the test fails on the first block that raises, naming the file and its line. A block
that cannot run here (it needs a cluster, or it is a fragment) is marked by an HTML
comment on the line right before its fence, which says why::

    <!-- no-run: needs a Databricks cluster -->
    ```python
    ...

A marker without a reason, an unknown word after ``python`` on the fence, or a
marker before anything but a python block fails the test.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FILE_TIMEOUT_S = 240

_FENCE = re.compile(r"^(\s*)```(.*)$")
_MARKER = re.compile(r"^\s*<!--\s*no-run\s*:?(.*?)-->\s*$")
_PYTHON = ("python", "py", "python3")


@dataclass(frozen=True)
class Block:
    line: int  # 1-based line of the first line of code (after the fence)
    code: str
    skip: str | None  # the no-run reason, or None: the block runs


def extract_blocks(text: str, where: str = "<doc>") -> list[Block]:
    """The python blocks of a Markdown text, each with its no-run reason (or None).

    Raises ValueError for a marker without a reason, a marker not right before a python
    fence, or a python fence with more than its language on it.
    """
    lines = text.splitlines()
    blocks: list[Block] = []
    i = 0
    pending: tuple[int, str] | None = None  # (line, reason) of a marker just seen
    while i < len(lines):
        line = lines[i]
        marker = _MARKER.match(line)
        if marker:
            reason = marker.group(1).strip()
            if not reason:
                raise ValueError(
                    f"{where}:{i + 1}: a no-run marker must say why: <!-- no-run: why -->"
                )
            pending = (i + 1, reason)
            i += 1
            continue
        fence = _FENCE.match(line)
        if not fence:
            if pending and line.strip():
                raise ValueError(
                    f"{where}:{pending[0]}: a no-run marker must be right before a ```python fence"
                )
            i += 1
            continue
        indent, info = fence.group(1), fence.group(2).strip()
        lang, _, rest = info.partition(" ")
        end = i + 1
        while end < len(lines) and not lines[end].strip().startswith("```"):
            end += 1
        if end == len(lines):
            raise ValueError(f"{where}:{i + 1}: a code fence is never closed")
        if lang.lower() in _PYTHON:
            if rest.strip():
                raise ValueError(
                    f"{where}:{i + 1}: ```{info}: put nothing after the language; mark a block "
                    "that must not run with <!-- no-run: why --> on the line before"
                )
            body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
            blocks.append(Block(i + 2, "\n".join(body) + "\n", pending[1] if pending else None))
        elif pending:
            raise ValueError(
                f"{where}:{pending[0]}: a no-run marker must be right before a ```python fence"
            )
        pending = None
        i = end + 1
    if pending:
        raise ValueError(f"{where}:{pending[0]}: a no-run marker at the end of the file")
    return blocks


_RUNNER = textwrap.dedent(
    """
    import json, sys, time, traceback


    def main():
        doc, blocks = sys.argv[1], json.load(open(sys.argv[2]))
        namespace = {"__name__": "__main__"}
        ran = 0
        try:
            for block in blocks:
                # leading newlines: a traceback's line numbers are the Markdown file's lines
                code = compile("\\n" * (block["line"] - 1) + block["code"], doc, "exec")
                started = time.monotonic()
                try:
                    exec(code, namespace)
                except BaseException:
                    traceback.print_exc()
                    print(f"DOC BLOCK FAILED: {doc}:{block['line']}", flush=True)
                    return 1
                ran += 1
                took = time.monotonic() - started
                print(f"DOC BLOCK {doc}:{block['line']} took {took:.1f} s", flush=True)
        finally:
            mods = sys.modules
            if "pyspark.sql" in mods:
                session = mods["pyspark.sql"].SparkSession.getActiveSession()
                if session is not None:
                    session.stop()
            if "ray" in mods and mods["ray"].is_initialized():
                mods["ray"].shutdown()
        print(f"DOC BLOCKS RAN: {ran}", flush=True)
        return 0


    if __name__ == "__main__":  # spawned worker processes import this file: run nothing then
        sys.exit(main())
    """
)


def _run_file(path: Path, blocks: list[Block], workdir: Path) -> subprocess.CompletedProcess:
    spec = workdir / "blocks.json"
    spec.write_text(json.dumps([{"line": b.line, "code": b.code} for b in blocks]))
    runner = workdir / "run_blocks.py"
    runner.write_text(_RUNNER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    env.pop("DATABRICKS_RUNTIME_VERSION", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    proc = subprocess.Popen(
        [sys.executable, str(runner), str(path.relative_to(ROOT)), str(spec)],
        cwd=workdir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group: a timeout ends all it started
    )
    try:
        out, _ = proc.communicate(timeout=FILE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(
            f"the blocks of {path.name} did not finish in {FILE_TIMEOUT_S} s:\n{out[-6000:]}"
        )
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


# ----------------------------------------------------------------------------- the extractor


def test_blocks_are_found_with_their_lines_and_markers():
    text = textwrap.dedent(
        """\
        # Title

        ```python
        x = 1
        ```

        <!-- no-run: needs a cluster -->
        ```python
        spark_runner.run(f)
        ```

        ```bash
        make test
        ```

        - a list item
          ```python
          y = x + 1
          ```
        """
    )
    blocks = extract_blocks(text)
    assert [(b.line, b.code, b.skip) for b in blocks] == [
        (4, "x = 1\n", None),
        (9, "spark_runner.run(f)\n", "needs a cluster"),
        (18, "y = x + 1\n", None),
    ]


@pytest.mark.parametrize(
    "text, message",
    [
        ("<!-- no-run -->\n```python\nx\n```\n", "must say why"),
        ("<!-- no-run: why -->\n\ntext\n```python\nx\n```\n", "right before"),
        ("<!-- no-run: why -->\n```bash\nx\n```\n", "right before"),
        ("```python no-run\nx\n```\n", "put nothing after the language"),
        ("```python\nx\n", "never closed"),
    ],
)
def test_a_badly_marked_block_is_an_error(text, message):
    with pytest.raises(ValueError, match=message):
        extract_blocks(text)


def test_every_doc_file_parses_and_says_why_a_block_does_not_run():
    for path in DOC_FILES:
        for block in extract_blocks(path.read_text(), path.name):
            assert block.skip is None or len(block.skip) > 5, (path.name, block.line)


# ------------------------------------------------------------------------- the docs themselves


def _runnable_files() -> list[Path]:
    return [p for p in DOC_FILES if any(b.skip is None for b in extract_blocks(p.read_text()))]


@pytest.mark.slow
@pytest.mark.timeout(FILE_TIMEOUT_S + 60)
@pytest.mark.parametrize("path", _runnable_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_unmarked_python_block_of_the_doc_runs(path, tmp_path):
    blocks = [b for b in extract_blocks(path.read_text(), path.name) if b.skip is None]
    result = _run_file(path, blocks, tmp_path)
    assert result.returncode == 0, f"a block of {path.name} failed:\n{result.stdout[-8000:]}"
    assert f"DOC BLOCKS RAN: {len(blocks)}" in result.stdout, result.stdout[-4000:]


# ------------------------------------------------------- the Horovod name table of the migration guide

_TABLE_HEADING = re.compile(r"^#{2,3} `(horovod[\w.]*)` → `([\w.]+)`\s*$")
_CHECK_NAMES = textwrap.dedent(
    """
    import importlib, json, sys

    problems = []
    for module_name, rows in json.load(open(sys.argv[1])).items():
        module = importlib.import_module(module_name)
        listed = set()
        for horovod, ours, status in rows:
            listed.add(ours)
            if status in ("same", "renamed", "ours only") and not hasattr(module, ours):
                problems.append(f"{module_name}.{ours} (for {horovod}, {status!r}) does not exist")
            if status == "not offered" and horovod in getattr(module, "__all__", ()):
                problems.append(f"{module_name}.{horovod} is marked 'not offered' but exists")
        for name in sorted(set(getattr(module, "__all__", ())) - listed):
            problems.append(f"{module_name}.{name} is exported but not in the table")
    print("\\n".join(problems))
    sys.exit(1 if problems else 0)
    """
)


def _name_tables(text: str) -> dict[str, list[tuple[str, str, str]]]:
    """Per ringtrain module, the rows (horovod name, our name, status) of its table."""
    tables: dict[str, list[tuple[str, str, str]]] = {}
    current: str | None = None
    for line in text.splitlines():
        heading = _TABLE_HEADING.match(line)
        if heading:
            current = heading.group(2)
            tables[current] = []
            continue
        if line.startswith("#"):
            current = None
        if current is None or not line.startswith("| ") or line.startswith("| Horovod"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        horovod, ours, status = (c.strip("`") for c in cells[:3])
        tables[current].append((horovod, ours, status))
    return tables


@pytest.mark.timeout(180)
def test_the_horovod_name_tables_match_the_modules_and_list_every_export(tmp_path):
    text = (ROOT / "docs" / "migrating-from-horovod.md").read_text()
    tables = _name_tables(text)
    assert {"ringcore.torch", "ringcore.torch.elastic", "ringcore.keras"} <= set(tables)
    for module, rows in tables.items():
        assert rows, f"the table of {module} has no rows"
        statuses = {status for _, _, status in rows}
        assert statuses <= {"same", "renamed", "not offered", "ours only"}, (module, statuses)
    spec = tmp_path / "tables.json"
    spec.write_text(json.dumps(tables))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", PYTHONWARNINGS="ignore")
    result = subprocess.run(
        [sys.executable, "-c", _CHECK_NAMES, str(spec)],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]


def test_the_guide_lists_every_ring_variable_the_code_reads():
    """Every ``"RING_..."`` name in the packages' sources is in the guide, and back."""
    names = set()
    for package in ("ringcore", "spark_runner", "ray_runner", "estimators", "ringrun"):
        for source in (ROOT / package).rglob("*.py"):
            names |= set(re.findall(r"\"(RING_[A-Z0-9_]+)\"", source.read_text()))
    guide = (ROOT / "docs" / "guide.md").read_text()
    section = guide[guide.index("## Tuning knobs") : guide.index("## Timeline")]
    documented = set(re.findall(r"`(RING_[A-Z0-9_]+)`", section)) - {"RING_X"}  # "RING_X" means any
    assert sorted(names - documented) == [], "add these to the knobs table of docs/guide.md"
    assert sorted(documented - names) == [], "the knobs table names variables no code reads"
