"""The run-services layer (``ringcore.runs``) that the estimators and ray_runner share:
light to import, one rule for a metrics dict's numbers, one event writer for local and
uploaded TensorBoard files, and both packages' stores and writers built on it."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from ringcore.runs import EventWriter, numeric, read_scalars


def test_importing_the_layer_loads_no_storage_tracking_or_framework_library():
    code = (
        "import sys, json, ringcore\n"
        "before = 'ringcore.runs' in sys.modules\n"
        "import ringcore.runs\n"
        "heavy = ('fsspec', 'mlflow', 'tensorboardX', 'pyarrow', 'torch', 'pyspark', 'ray')\n"
        "print(json.dumps([before, sorted(m for m in heavy if m in sys.modules)]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == [False, []]


def test_numeric_keeps_numbers_by_one_rule_with_each_sides_options():
    metrics = {"loss": 0.5, "n": 3, "ok": True, "name": "x", "bad": math.nan, "opt": {"lr": 0.1}}
    # ray_runner's reports (MLflow, TensorBoard): nested flattened, finite only
    assert numeric(metrics) == {"loss": 0.5, "n": 3.0, "opt/lr": 0.1}
    # the estimators' history entries: top level, NaN kept (a diverged epoch is logged)
    kept = numeric(metrics, skip=("n",), nested=False, finite=False)
    assert kept.keys() == {"loss", "bad"} and math.isnan(kept["bad"])


def test_an_uploading_event_writer_hands_its_files_over_and_leaves_no_temporary(tmp_path):
    pytest.importorskip("tensorboardX")
    uploaded: dict[str, bytes] = {}
    writer = EventWriter(upload=lambda name, data: uploaded.__setitem__(name, data))
    temporary = writer.folder
    for step in (1, 2):
        writer.add("loss", 1.0 / step, step)
    writer.close()
    assert not os.path.exists(temporary)
    for name, data in uploaded.items():
        (tmp_path / name).write_bytes(data)
    assert read_scalars(str(tmp_path)) == {"loss": [(1, 1.0), (2, 0.5)]}


def test_both_packages_stores_and_writers_are_the_layers():
    pytest.importorskip("ray")
    import ray_runner._mlflow_callback as ray_mlflow
    import ray_runner._tbx_callback as ray_tbx
    from estimators import FsspecStore, LocalStore
    from estimators.tracking import _mlflow as est_mlflow
    from ringcore.runs import FsspecRunStore, LocalRunStore, MlflowLog

    assert issubclass(LocalStore, LocalRunStore) and issubclass(FsspecStore, FsspecRunStore)
    assert ray_mlflow.MlflowLog is MlflowLog is est_mlflow.MlflowLog
    assert ray_tbx.EventWriter is EventWriter
