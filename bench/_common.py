"""What every benchmark in bench/ shares, so that each states its method once and alike.

A skeptic's questions, answered in one place instead of per script: how many rounds
(:data:`MIN_ROUNDS` at least, the peers' order swapped every round so that a noisy
moment or a warm cache does not always favour the same side), which statistic (the
median, with the min-max and the quartiles beside it), which clock (each rank times
itself; the slowest rank of a round is the round's figure), on which code and machine
(commit, dirty tree, versions, cores, CPU model, load average before and after,
whether ``RING_SHM`` was set), and whether both sides computed the same thing (a
check, passed or failed, in the JSON). ``tools/bench_tables.py`` renders the JSON's
``table`` into docs/status.md, so no figure is typed by hand.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
SCHEMA = 2  # bench/results/*.json without "schema" predate this module
MIN_ROUNDS = 5


def add_common_args(parser: argparse.ArgumentParser, rounds: int = MIN_ROUNDS) -> None:
    """``--quick``, ``--rounds`` and ``--out``, the same in every script."""
    parser.add_argument(
        "--quick", action="store_true", help="small sizes (still >= 5 rounds), <= 60 s"
    )
    parser.add_argument(
        "--rounds", type=int, default=rounds, help=f"rounds, >= {MIN_ROUNDS} (default {rounds})"
    )
    parser.add_argument(
        "--out", type=pathlib.Path, default=RESULTS, help="folder of the JSON (bench/results)"
    )


def check_rounds(rounds: int) -> int:
    """``rounds``, refused below :data:`MIN_ROUNDS`: fewer cannot give a median and a spread."""
    if rounds < MIN_ROUNDS:
        raise SystemExit(
            f"--rounds {rounds} is too few: a median and a spread need >= {MIN_ROUNDS} rounds; "
            f"pass --rounds {MIN_ROUNDS} or more"
        )
    return rounds


P = TypeVar("P")  # a peer: its name, or (name, layout)


def orders(peers: Sequence[P], rounds: int) -> list[list[P]]:
    """The peers' order in every round: as given in even rounds, reversed in odd ones."""
    return [list(peers) if r % 2 == 0 else list(reversed(peers)) for r in range(rounds)]


def slowest(per_rank: Sequence[Sequence[float]]) -> list[float]:
    """The figure of every round: the slowest rank's time (a job runs at its slowest rank)."""
    if not per_rank or len({len(r) for r in per_rank}) != 1:
        raise ValueError(f"every rank must report the same number of rounds, got {per_rank!r}")
    return [max(values) for values in zip(*per_rank)]


def summary(values: Iterable[float]) -> dict[str, Any]:
    """Median, min, max, quartiles and every value of one row's rounds."""
    xs = [float(v) for v in values]
    if not xs:
        raise ValueError("summary() of no values: the row was not measured")
    q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive") if len(xs) > 1 else (xs * 3)
    return {
        "median": statistics.median(xs),
        "min": min(xs),
        "max": max(xs),
        "q1": q1,
        "q3": q3,
        "n": len(xs),
        "all": xs,
    }


def spread(s: dict[str, Any], scale: float = 1.0, fmt: str = "{:.3g}") -> str:
    """``median (min-max)`` of a :func:`summary`, for tables."""
    return (
        f"{fmt.format(s['median'] * scale)} "
        f"({fmt.format(s['min'] * scale)}-{fmt.format(s['max'] * scale)})"
    )


def target(
    name: str,
    value: float | None,
    goal: float,
    *,
    lower_is_better: bool,
    why_missed: str = "",
    note: str = "",
) -> dict[str, Any]:
    """One target of issue 21: met, missed (with the reason), or not measured (``value`` None)."""
    out: dict[str, Any] = {
        "target": name,
        "value": value,
        "goal": goal,
        "lower_is_better": lower_is_better,
    }
    if value is None:
        out.update(met=None, why_missed=note or "not measured in this run")
        return out
    out["met"] = value <= goal if lower_is_better else value >= goal
    if not out["met"]:
        out["why_missed"] = why_missed or "no reason recorded"
    if note:
        out["note"] = note
    return out


def check(what: str, passed: bool, detail: str = "") -> dict[str, Any]:
    """That both sides computed the same result (weights, loss, a collective's output)."""
    return {"check": what, "passed": bool(passed), "detail": detail}


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def _cpu_model() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(packages: Sequence[str] = ("torch",)) -> dict[str, Any]:
    """Where and on what the benchmark ran, taken before it starts (see :func:`finish`).

    ``dirty`` ignores bench/results/: an earlier script of ``make bench`` writing its JSON
    does not make the code of the next one different.
    """
    status = _git("status", "--porcelain")
    changed = [
        ln for ln in status.splitlines() if ln[3:] and not ln[3:].startswith("bench/results/")
    ]
    return {
        "commit": _git("rev-parse", "HEAD") or "unknown (not a git checkout)",
        "dirty": bool(changed),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv[1:],
        "versions": {
            "python": platform.python_version(),
            **{p: _version(p) for p in packages},
        },
        "machine": {
            "platform": platform.platform(),
            "cores": os.cpu_count(),
            "cpu_model": _cpu_model(),
            "load_before": list(os.getloadavg()),
        },
        "RING_SHM": os.environ.get("RING_SHM"),
    }


def data_plane() -> dict[str, Any]:
    """What carried ours' data on this rank (call after ``init()``, in a worker), from
    ``ringcore.launch.data_plane()``: the backend, the mode ("flat"/"hierarchical" when
    the shared-memory plane holds, else "network") and the ops each path carried;
    ``shm`` names the shared-memory mode (empty on the network path). ``RING_SHM`` in
    the environment says what was asked; this says what the engine holds."""
    from ringcore.launch import data_plane as plane

    found = plane() or {"backend": None, "mode": "network", "ops": {}, "engine": {}}
    return {**found, "shm": [] if found["mode"] == "network" else [found["mode"]]}


def finish(env: dict[str, Any]) -> dict[str, Any]:
    """The environment with the load average after the run and the wall time added."""
    started = datetime.datetime.fromisoformat(env["started"])
    now = datetime.datetime.now(datetime.timezone.utc)
    env["machine"]["load_after"] = list(os.getloadavg())
    env["wall_s"] = round((now - started).total_seconds(), 1)
    return env


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> dict[str, Any]:
    """A table as the JSON keeps it (cells as strings): what is printed, and what
    tools/bench_tables.py renders into the docs."""
    return {"headers": list(headers), "rows": [[str(c) for c in row] for row in rows]}


def print_table(t: dict[str, Any]) -> None:
    """A :func:`table` in aligned columns on stdout."""
    cells = [t["headers"], *t["rows"]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(t["headers"]))]
    for n, row in enumerate(cells):
        print(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))
            )
        )
        if n == 0:
            print("  ".join("-" * w for w in widths))


def print_verdicts(targets: Sequence[dict[str, Any]], checks: Sequence[dict[str, Any]]) -> None:
    for t in targets:
        verdict = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        value = "-" if t["value"] is None else f"{t['value']:.3g}"
        print(f"target {t['target']}: {value} -> {verdict}")
    for c in checks:
        print(f"check {c['check']}: {'passed' if c['passed'] else 'FAILED'} {c['detail']}")


def write(
    name: str,
    out_dir: pathlib.Path,
    env: dict[str, Any],
    body: dict[str, Any],
    *,
    quick: bool,
    rounds: int,
) -> pathlib.Path:
    """Write ``out_dir/<name>.json`` with the shared fields first; returns its path.

    ``body`` must hold ``table`` (from :func:`table`), ``targets`` and ``checks`` lists.
    """
    for key in ("table", "targets", "checks"):
        if key not in body:
            raise ValueError(f"{name}: the report lacks {key!r}; every benchmark records it")
    report = {
        "schema": SCHEMA,
        "benchmark": name,
        "quick": quick,
        "rounds": rounds,
        "order": "peers swapped every round (as listed in even rounds, reversed in odd ones)",
        "statistic": "median of the rounds; spread min-max and quartiles",
        "checks_passed": all(c["passed"] for c in body["checks"]),
        "environment": finish(env),
        **body,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")
    return path
