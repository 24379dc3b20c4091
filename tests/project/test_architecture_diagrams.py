"""docs/architecture.md's import diagrams are the code's: drawn by tools/architecture.py."""

from __future__ import annotations

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architecture)


def test_the_documents_diagrams_are_drawn_from_todays_imports():
    text = architecture.DOC.read_text()
    assert "<!-- generated:packages -->" in text and "<!-- generated:rooms -->" in text
    assert architecture.rendered(text) == text, (
        "docs/architecture.md's diagrams drifted from the code: run python tools/architecture.py"
    )


def test_a_new_import_between_packages_changes_the_drawing(tmp_path, monkeypatch):
    for package in architecture.PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "ringcore" / "launch.py").write_text("")
    (tmp_path / "spark_runner" / "_run.py").write_text(
        "def f():\n    from ringcore import launch\n"
    )
    real = architecture.import_graph
    monkeypatch.setattr(architecture, "import_graph", lambda p: real(p, tmp_path))
    drawn = architecture.packages_diagram()
    assert "spark_runner --> ringcore_launch" in drawn
    assert "ray_runner -->" not in drawn
