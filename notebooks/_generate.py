"""Writes each notebook ``NN_name.ipynb`` of this folder from its source ``NN_name.py``.

The sources are Python files in jupytext's percent format: ``# %%`` starts a code cell,
``# %% [markdown]`` a Markdown cell whose lines are comments. They are plain Python that
ruff lints and formats like the rest of the project; Jupyter (with jupytext), VS Code,
PyCharm and Databricks open them as notebooks too.

Edit the ``.py``, then regenerate the notebooks and commit both::

    python notebooks/_generate.py

``tests/end_to_end/test_notebooks.py`` fails when a stored notebook differs from what this script
writes (or holds outputs), and executes every notebook headless. The ``.ipynb`` are
stored without outputs, with stable cell ids (``cell-00``, ...), so a rebuild of an
unchanged source changes nothing.

Every notebook runs as is on Databricks and in a local Jupyter: it uses the notebook's
``spark`` when there is one (never its SparkContext, which shared-access and serverless
compute do not give), else builds a local session; its files go under a Unity Catalog
volume on Databricks (``DATABRICKS_RUNTIME_VERSION`` set; ``RING_NOTEBOOK_VOLUME``, default
``/Volumes/main/default/ringtrain``), else into a new temporary directory. ``RING_NOTEBOOK_QUICK=1`` (the tests set it) trains for fewer
epochs so that the five notebooks run in a few minutes on two cores.
"""

from __future__ import annotations

import sys
from pathlib import Path

import jupytext
import nbformat

HERE = Path(__file__).resolve().parent
METADATA = {
    "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
    "language_info": {"name": "python"},
}


def sources() -> list[Path]:
    """The notebook sources: ``NN_name.py``, in order."""
    return sorted(HERE.glob("[0-9][0-9]_*.py"))


def build(source: Path) -> str:
    """The JSON text of the notebook made from ``source``, as stored beside it."""
    nb = jupytext.read(source, fmt="py:percent")
    nb.metadata = dict(METADATA)
    for index, cell in enumerate(nb.cells):
        cell.id = f"cell-{index:02d}"  # stable ids: a rebuild changes nothing
        cell.metadata.pop("lines_to_next_cell", None)  # a layout hint of the .py only
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main() -> int:
    for source in sources():
        target = source.with_suffix(".ipynb")
        target.write_text(build(source))
        print("wrote", target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
