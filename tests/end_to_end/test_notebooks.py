"""The notebooks under notebooks/: each ``NN_name.ipynb`` stored without outputs, as
notebooks/_generate.py writes it from its source ``NN_name.py`` (jupytext's percent
format), and each one executed headless on a kernel of this interpreter, failing on any
cell error.

The kernel is this test's own Python (``sys.executable -m ipykernel_launcher``) through
a kernelspec in a temporary ``JUPYTER_PATH``; the Jupyter and IPython directories are
temporary too, so nothing is written under the user's home. ``RING_NOTEBOOK_QUICK=1``
makes the notebooks train for few epochs; ``MPLBACKEND=Agg`` draws without a display.
Every process the kernel started (Spark's JVM, Ray's daemons, workers) must be gone
once the kernel is shut down; the test ends any that are left, and fails.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
psutil = pytest.importorskip("psutil")
pytest.importorskip("ipykernel")
pytest.importorskip("jupytext")

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = ROOT / "notebooks"
KERNEL_NAME = "ringtrain-test"
CELL_TIMEOUT_S = 240

# Every notebook of notebooks/ is executed, but those listed here with the reason.
NOT_EXECUTED: dict[str, str] = {}


def _generator():
    spec = importlib.util.spec_from_file_location("notebooks_generate", NOTEBOOKS / "_generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _notebook_names() -> list[str]:
    return [source.with_suffix(".ipynb").name for source in _generator().sources()]


def _stored() -> list[str]:
    return sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


def test_the_notebooks_are_the_ones_their_sources_generate_without_outputs():
    generate = _generator()
    sources = generate.sources()
    assert sources, "no notebook source notebooks/NN_name.py"
    assert _stored() == _notebook_names(), (
        "every notebooks/NN_name.ipynb is generated from a notebooks/NN_name.py beside it; "
        "a source or a notebook is missing: run `python notebooks/_generate.py`"
    )
    for source in sources:
        name = source.with_suffix(".ipynb").name
        text = (NOTEBOOKS / name).read_text()
        assert text == generate.build(source), (
            f"notebooks/{name} differs from what its source notebooks/{source.name} generates; "
            "edit the .py and run `python notebooks/_generate.py`"
        )
        nb = nbformat.reads(text, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, f"{name} holds outputs"
    assert set(NOT_EXECUTED) <= set(_notebook_names())


# What shared-access and serverless Databricks compute refuse (the SparkContext and the
# JVM behind it), and the DBFS root that Unity Catalog workspaces deprecate.
_NOT_ON_SHARED_COMPUTE = re.compile(
    r"\.sparkContext\b|\bSparkContext\s*[.(]|\._jvm\b|\._jsc\b|/dbfs\b|dbfs:/"
)


def test_the_notebooks_hold_no_sparkcontext_access_nor_dbfs_root_paths_and_stop_their_ray():
    sources = _generator().sources()
    for source in sources:
        text = source.read_text()
        found = [m.group(0) for m in _NOT_ON_SHARED_COMPUTE.finditer(text)]
        assert not found, f"notebooks/{source.name} holds {found}: not on shared compute"
        if "setup_ray_cluster(" in text:  # Ray-on-Spark started here is shut down here
            assert "shutdown_ray_cluster()" in text.split("setup_ray_cluster(", 1)[1], source.name
        if "DATABRICKS_RUNTIME_VERSION" in text and "WORK_DIR" in text:
            assert "RING_NOTEBOOK_VOLUME" in text and "/Volumes/" in text, source.name
    assert any("setup_ray_cluster(" in s.read_text() for s in sources)


@pytest.fixture(scope="module")
def kernel_env(tmp_path_factory):
    """A kernelspec for this interpreter in a temporary JUPYTER_PATH, and the kernel's env."""
    base = tmp_path_factory.mktemp("jupyter")
    spec_dir = base / "data" / "kernels" / KERNEL_NAME
    spec_dir.mkdir(parents=True)
    (spec_dir / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "ringtrain (tests)",
                "language": "python",
            }
        )
    )
    env = {
        "JUPYTER_PATH": str(base / "data"),
        "JUPYTER_DATA_DIR": str(base / "data"),
        "JUPYTER_RUNTIME_DIR": str(base / "runtime"),
        "JUPYTER_CONFIG_DIR": str(base / "config"),
        "IPYTHONDIR": str(base / "ipython"),
        "JUPYTER_PLATFORM_DIRS": "1",
        "RING_NOTEBOOK_QUICK": "1",
        "MPLBACKEND": "Agg",
        "PYTHONWARNINGS": "ignore",
        "TF_CPP_MIN_LOG_LEVEL": "2",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    os.environ.pop("DATABRICKS_RUNTIME_VERSION", None)
    try:
        yield env
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _descendants(pid: int) -> set:
    try:
        return set(psutil.Process(pid).children(recursive=True))
    except psutil.NoSuchProcess:
        return set()


def _execute(path: Path, workdir: Path) -> Any:
    """Run every cell of ``path`` on a fresh kernel; raise on the first cell error; the
    executed notebook.

    Afterwards, every process the kernel started must have ended with it.
    """
    nb = nbformat.read(path, as_version=4)
    client = nbclient.NotebookClient(
        nb,
        kernel_name=KERNEL_NAME,
        timeout=CELL_TIMEOUT_S,
        startup_timeout=120,
        resources={"metadata": {"path": str(workdir)}},
    )
    started: set = set()
    client.reset_execution_trackers()
    try:
        with client.setup_kernel():
            kernel_pid = client.km.provisioner.pid
            try:
                for index, cell in enumerate(nb.cells):
                    started |= _descendants(kernel_pid)
                    client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            finally:
                started |= _descendants(kernel_pid)
    finally:
        _, alive = psutil.wait_procs(list(started), timeout=30)
        for proc in alive:  # only processes this notebook's kernel started
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    left = [f"{p.pid} {p.name()}" for p in alive if p.is_running()]
    assert not alive, f"{path.name} left processes running after its kernel ended: {left or alive}"
    return nb


def _outputs_of(nb: Any, code: str) -> list[dict]:
    """The outputs of the code cell whose source contains ``code``."""
    (cell,) = [c for c in nb.cells if c.cell_type == "code" and code in c.source]
    return list(cell.outputs)


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n in _notebook_names() if n not in NOT_EXECUTED])
def test_the_notebook_runs_headless_without_a_cell_error(name, kernel_env, tmp_path):
    nb = _execute(NOTEBOOKS / name, tmp_path)
    if name.startswith("01_"):  # issue 23: the fit's progress bar and the TensorBoard curves
        fit = _outputs_of(nb, "ring_model = estimator.fit(train_df)")
        assert any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in fit)
        tags = "".join(o.get("text", "") for o in _outputs_of(nb, "read_tensorboard_scalars(store"))
        assert "epoch/train_loss" in tags and "epoch/val_loss" in tags and "step/loss" in tags
