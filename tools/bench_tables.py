"""Write the benchmark figures of the docs from bench/results/*.json (``make bench`` last step).

No figure in docs/status.md (or README.md) is typed by hand: each quoted benchmark sits
in a marked block::

    <!-- bench:begin collectives -->
    ... written by this tool from bench/results/collectives.json ...
    <!-- bench:end collectives -->

and this tool rewrites every such block from the JSON of that name: a line saying on
which commit, machine and load it ran and whether every check passed, the table the
script printed, and every target met or missed with its reason. A JSON from before
``bench/_common.py`` (no ``schema``) is named as such and its figures are not quoted,
since it recorded neither commit, rounds nor checks; a JSON in the shared schema that
lacks any of them (or a reason for a missed target) stops the tool naming the field. ``--check`` changes nothing and
exits 1 when a block differs from what the JSON gives (a hand edit, or a stale block);
tests/project/test_bench_tables.py runs it. Usage:

    python tools/bench_tables.py [--check] [--results bench/results] [FILE ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
FILES = [ROOT / "docs" / "status.md", ROOT / "README.md"]
_BLOCK = re.compile(
    r"(<!-- bench:begin (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- bench:end (?P=name) -->)",
    re.DOTALL,
)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _markdown_table(t: dict[str, Any]) -> list[str]:
    lines = ["| " + " | ".join(_cell(h) for h in t["headers"]) + " |"]
    lines.append("|" + "---|" * len(t["headers"]))
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in t["rows"]]
    return lines


def _provenance(name: str, data: dict[str, Any]) -> str:
    env = data["environment"]
    m = env["machine"]
    load = f"load {m['load_before'][0]:.2f} -> {m.get('load_after', ['?'])[0]:.2f}"
    failed = [c["check"] for c in data["checks"] if not c["passed"]]
    checks = "every check passed" if not failed else f"{len(failed)} check(s) FAILED"
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    planes = data.get("data_plane_per_rank")
    if planes:  # what the engine held, beside what RING_SHM asked for
        held = sum(1 for p in planes if p.get("shm"))
        versions += f"; ours held a shared-memory group on {held} of {len(planes)} ranks"
    # the load before the run: the one after includes the benchmark's own processes
    busy = (
        f" **The machine was busy before the run (1-min load {m['load_before'][0]:.2f} on "
        f"{m['cores']} cores): rerun on a quiet one before trusting these figures.**"
        if m["load_before"][0] > BUSY_LOAD_PER_CORE * m["cores"]
        else ""
    )
    return (
        f"`bench/results/{name}.json`: commit `{env['commit'][:10]}`"
        f"{' (dirty tree)' if env['dirty'] else ''}, {env['started']}, "
        f"{data['rounds']} rounds{' (--quick)' if data['quick'] else ''}, "
        f"{m['cores']} cores ({m['cpu_model']}), {load}; RING_SHM "
        f"{'set' if env.get('RING_SHM') else 'unset'}; {versions}; {checks}.{busy}"
    )


def _target_line(t: dict[str, Any]) -> str:
    value = "not measured" if t["value"] is None else f"{t['value']:.3g}"
    verdict = {True: "met", False: "**missed**", None: "not measured"}[t["met"]]
    why = f" — {t['why_missed']}" if t["met"] is not True and t.get("why_missed") else ""
    return f"- {t['target']}: {value}, {verdict}{why}"


MIN_ROUNDS = 5  # bench/_common.py's
BUSY_LOAD_PER_CORE = 0.5  # a 1-min load before the run above this per core: noisy figures


def validate(name: str, data: dict[str, Any]) -> None:
    """Refuse to quote a result that lacks what a skeptic checks: the commit, versions,
    machine and load, >= 5 rounds, the checks, and a reason for every target not met."""
    env = data.get("environment") or {}
    machine = env.get("machine") or {}
    missing = [
        field
        for field, present in (
            ("environment.commit", env.get("commit")),
            ("environment.versions", env.get("versions")),
            ("environment.machine.cores", machine.get("cores")),
            ("environment.machine.load_before", machine.get("load_before")),
            ("environment.machine.load_after", machine.get("load_after")),
            ("checks", data.get("checks")),
            ("table.rows", (data.get("table") or {}).get("rows")),
        )
        if not present
    ]
    if "targets" not in data:
        missing.append("targets")
    missing += [
        f"targets[{i}].why_missed"
        for i, t in enumerate(data.get("targets", []))
        if t.get("met") is not True and not t.get("why_missed")
    ]
    if missing:
        raise SystemExit(
            f"bench/results/{name}.json lacks {', '.join(missing)}: it was not written by "
            f"bench/_common.py's write(); rerun python bench/{name}.py"
        )
    if data.get("rounds", 0) < MIN_ROUNDS:
        raise SystemExit(
            f"bench/results/{name}.json has {data.get('rounds')} rounds; a median and a spread "
            f"need >= {MIN_ROUNDS}: rerun python bench/{name}.py --rounds {MIN_ROUNDS}"
        )


def render(name: str, data: dict[str, Any]) -> str:
    """The block's body for one result file (ends with a newline)."""
    if data.get("schema", 1) < 2:
        return (
            f"`bench/results/{name}.json` predates the shared method of `bench/_common.py` "
            "(no commit, rounds, slowest-rank times or checks recorded), so its figures are "
            f"not quoted here; `python bench/{name}.py` on a quiet machine rewrites it.\n"
        )
    validate(name, data)
    lines = [_provenance(name, data), "", *_markdown_table(data["table"])]
    for extra in data.get("more_tables", []):  # a second kind of row (e.g. a training step)
        lines += ["", *_markdown_table(extra)]
    if data["targets"]:
        lines += ["", *(_target_line(t) for t in data["targets"])]
    return "\n".join(lines) + "\n"


def load(results: pathlib.Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(results.glob("*.json"))}


def update(text: str, data: dict[str, dict[str, Any]], where: str = "<doc>") -> str:
    """``text`` with every bench block rewritten; a block naming no result file fails."""

    def body(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in data:
            raise SystemExit(
                f"{where}: block 'bench:begin {name}' names bench/results/{name}.json, which "
                f"does not exist (have: {', '.join(sorted(data))}); run bench/{name}.py or "
                "remove the block"
            )
        return match.group(1) + render(name, data[name]) + match.group(4)

    return _BLOCK.sub(body, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block is stale")
    parser.add_argument("--results", type=pathlib.Path, default=RESULTS)
    parser.add_argument("files", nargs="*", type=pathlib.Path, default=FILES)
    args = parser.parse_args(argv)
    data = load(args.results)
    stale = []
    for path in args.files:
        if not path.exists():
            continue
        old = path.read_text()
        new = update(old, data, str(path))
        if new != old:
            stale.append(path)
            if not args.check:
                path.write_text(new)
    for path in stale:
        print(f"{path}: {'stale bench block(s)' if args.check else 'rewritten'}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
