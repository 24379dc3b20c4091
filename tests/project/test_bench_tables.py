"""tools/bench_tables.py: the docs' benchmark blocks come from bench/results/*.json only.

A fixture JSON in the shared schema renders to its provenance line, its table and its
targets (a missed one with its reason); an old-schema JSON is named, never quoted; and
docs/status.md's blocks are exactly what the generator writes from the committed JSON,
so a figure typed by hand into a block fails here.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_tables", ROOT / "tools" / "bench_tables.py")
bench_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_tables)

FIXTURE = {
    "schema": 2,
    "benchmark": "demo",
    "quick": False,
    "rounds": 5,
    "environment": {
        "commit": "0123456789abcdef",
        "dirty": True,
        "started": "2026-12-04T06:00:00+00:00",
        "versions": {"python": "3.12.1", "torch": "2.13.0", "ray": None},
        "machine": {
            "cores": 2,
            "cpu_model": "Test CPU",
            "load_before": [0.5, 0.4, 0.3],
            "load_after": [1.25, 0.5, 0.3],
        },
        "RING_SHM": None,
    },
    "table": {"headers": ["op", "peer", "ms"], "rows": [["allreduce 4 KB", "ours", "2.1 (2-3)"]]},
    "targets": [
        {"target": "t met", "value": 0.2, "goal": 0.25, "lower_is_better": True, "met": True},
        {
            "target": "t missed",
            "value": 0.93,
            "goal": 0.25,
            "lower_is_better": True,
            "met": False,
            "why_missed": "same Gloo call",
        },
    ],
    "checks": [{"check": "outputs equal", "passed": True, "detail": ""}],
}


def test_a_fixture_renders_provenance_table_and_targets(tmp_path):
    (tmp_path / "demo.json").write_text(json.dumps(FIXTURE))
    (tmp_path / "old.json").write_text(json.dumps({"rows": [{"ratio": 1.2}]}))
    doc = tmp_path / "doc.md"
    doc.write_text(
        "intro\n<!-- bench:begin demo -->\nhand-typed 9.9x\n<!-- bench:end demo -->\n"
        "<!-- bench:begin old -->\n<!-- bench:end old -->\nend\n"
    )
    args = ["--results", str(tmp_path), str(doc)]
    assert bench_tables.main([*args, "--check"]) == 1  # the hand-typed block is stale
    assert bench_tables.main(args) == 0
    text = doc.read_text()
    assert "hand-typed" not in text and text.startswith("intro\n") and text.endswith("end\n")
    assert "commit `0123456789` (dirty tree)" in text and "5 rounds" in text
    assert "load 0.50 -> 1.25" in text and "torch 2.13.0" in text and "ray" not in text
    assert "every check passed" in text
    assert "busy" not in text  # load 0.5 before the run on 2 cores: quiet
    assert "| op | peer | ms |\n|---|---|---|\n| allreduce 4 KB | ours | 2.1 (2-3) |" in text
    assert "- t met: 0.2, met\n" in text
    assert "- t missed: 0.93, **missed** — same Gloo call" in text
    assert "`bench/results/old.json` predates" in text and "1.2" not in text.split("old -->")[1]
    assert bench_tables.main([*args, "--check"]) == 0  # written once, then up to date


def test_a_block_without_its_json_names_the_file(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:begin nothere -->\n<!-- bench:end nothere -->\n")
    with pytest.raises(SystemExit, match=r"bench/results/nothere\.json"):
        bench_tables.main(["--results", str(tmp_path), str(doc)])


def test_the_docs_blocks_are_what_the_committed_json_gives():
    data = bench_tables.load(ROOT / "bench" / "results")
    for path in bench_tables.FILES:
        text = path.read_text()
        assert bench_tables.update(text, data, str(path)) == text, (
            f"{path.name}: a bench block differs from bench/results/*.json; "
            "run python tools/bench_tables.py (never edit the blocks by hand)"
        )
    status = (ROOT / "docs" / "status.md").read_text()
    for name in ("collectives", "training", "keras", "spark_launch", "estimator", "ray_trainer"):
        assert f"<!-- bench:begin {name} -->" in status, f"docs/status.md lacks the {name} block"


def _variant(**changes) -> dict:
    data = json.loads(json.dumps(FIXTURE))
    for path, value in changes.items():
        *parents, leaf = path.split(".")
        node = data
        for key in parents:
            node = node[key]
        if value is None:
            del node[leaf]
        else:
            node[leaf] = value
    return data


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"environment.machine.load_after": None}, r"lacks environment\.machine\.load_after"),
        ({"environment.commit": ""}, r"lacks environment\.commit"),
        ({"checks": []}, r"lacks checks"),
        (
            {"targets": [{"target": "t", "value": 2.0, "goal": 1.0, "met": False}]},
            r"lacks targets\[0\]\.why_missed",
        ),
        ({"rounds": 3}, r"3 rounds; .* >= 5"),
    ],
)
def test_a_result_lacking_what_a_skeptic_checks_is_refused_naming_it(tmp_path, changes, message):
    (tmp_path / "demo.json").write_text(json.dumps(_variant(**changes)))
    doc = tmp_path / "doc.md"
    doc.write_text("<!-- bench:begin demo -->\n<!-- bench:end demo -->\n")
    with pytest.raises(SystemExit, match=message):
        bench_tables.main(["--results", str(tmp_path), str(doc)])
    assert "bench:begin demo -->\n<!--" in doc.read_text()  # nothing written


def test_the_provenance_says_what_data_plane_ours_held():
    shm = {"backend": "gloo", "backend_class": "X", "shm": ["X.group: ShmGroup"]}
    plain = {"backend": "gloo", "backend_class": "X", "shm": []}
    text = bench_tables.render("demo", {**FIXTURE, "data_plane_per_rank": [shm, plain]})
    assert "ours held a shared-memory group on 1 of 2 ranks" in text


def test_a_run_on_a_busy_machine_is_marked_as_such():
    busy = _variant(**{"environment.machine.load_before": [3.5, 1.0, 0.5]})
    text = bench_tables.render("demo", busy)
    assert "The machine was busy before the run (1-min load 3.50 on 2 cores)" in text
