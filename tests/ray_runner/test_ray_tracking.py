"""RingTrainer's tracking on a real local Ray instance (2 CPUs, 2 workers, a tiny loop):
ray_runner.MLflowLoggerCallback (a real MLflow file store under tmp_path),
ray_runner.TBXLoggerCallback (event files read back with estimators' reader, in the run
folder and through a non-local filesystem) and the driver's live progress lines.
"""

from __future__ import annotations

import io
import os
import re

import pytest
from _servers import local_ray

ray = pytest.importorskip("ray")
pytest.importorskip("mlflow")
pytest.importorskip("tensorboardX")

from ray_runner import (  # noqa: E402
    Checkpoint,
    MLflowLoggerCallback,
    RingTrainer,
    RunConfig,
    ScalingConfig,
    TBXLoggerCallback,
    TrainingFailedError,
    _progress,
)
from ringcore.progress import ProgressDisplay  # noqa: E402
from ringcore.runs import read_scalars  # noqa: E402

REPORTS = 30
SHARED_RAY = True  # on the suite's shared local Ray instance (tests/_servers.py local_ray)


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(__name__):  # the worker functions here travel by value
        yield


def _loop(config: dict) -> None:
    import tempfile

    import ray_runner
    import ringcore

    ringcore.init()
    for i in range(1, config["reports"] + 1):
        if config.get("fail_at") == i:
            raise RuntimeError("the loop fails on purpose")
        metrics = {"loss": 1.0 / i, "acc": i / config["reports"], "note": "text"}
        if i == config["reports"] and ringcore.rank() == 0:
            with tempfile.TemporaryDirectory() as folder:
                with open(os.path.join(folder, "weights.txt"), "w") as f:
                    f.write(f"step {i}")
                ray_runner.report(metrics, checkpoint=Checkpoint.from_directory(folder))
        else:
            ray_runner.report(metrics)


def _fit(tmp_path, name, callbacks, **config):
    return RingTrainer(
        _loop,
        train_loop_config={"reports": REPORTS, "lr": 0.1, "opt": {"name": "sgd"}, **config},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name=name, storage_path=str(tmp_path / "runs"), callbacks=callbacks),
    ).fit()


_LINE = re.compile(r"^step (\d+)  loss (\d+\.\d{4})  acc [\d.e-]+(  [\d.]+ steps/s)?$", re.M)


@pytest.mark.timeout(240)
def test_mlflow_and_tbx_log_every_report_at_its_step_and_progress_lines_stay_few(
    ray_cluster, tmp_path, monkeypatch, capsys
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setattr(ProgressDisplay, "plain_interval_s", 0.0)  # every update as a line
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file tracking store
    uri = (tmp_path / "mlruns").as_uri()
    mlflow_cb = MLflowLoggerCallback(
        uri, experiment_name="ray-tracking", tags={"team": "ring"}, save_artifact=True
    )
    logdir = tmp_path / "tb"
    result = _fit(tmp_path, "tracked", [mlflow_cb, TBXLoggerCallback(), TBXLoggerCallback(logdir)])
    out = capsys.readouterr().out

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(mlflow_cb.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "tracked"
    assert run.data.params == {"reports": str(REPORTS), "lr": "0.1", "opt/name": "sgd"}
    assert run.data.tags["team"] == "ring" and run.data.tags["ringtrain.run_path"] == result.path
    history = client.get_metric_history(run.info.run_id, "loss")
    assert sorted((m.step, m.value) for m in history) == [
        (i, 1.0 / i) for i in range(1, REPORTS + 1)
    ]
    assert "note" not in run.data.metrics  # text is not a metric
    (artifact,) = client.list_artifacts(run.info.run_id, "checkpoint")
    assert artifact.path == "checkpoint/weights.txt"

    for folder in (result.path, str(logdir)):  # the run folder, and the given logdir
        scalars = read_scalars(folder)
        assert set(scalars) == {"loss", "acc"}
        assert scalars["loss"] == [(i, pytest.approx(1.0 / i)) for i in range(1, REPORTS + 1)]

    lines = _LINE.findall(out)
    steps = [int(m.group(1)) for m in _LINE.finditer(out)]
    assert steps[-1] == REPORTS and steps == sorted(steps)  # the last report always shows
    assert 1 <= len(lines) < REPORTS  # one line per display update, not per report
    assert out.count("[RingTrainer] iteration ") == REPORTS  # verbose lines, through the display


@pytest.mark.timeout(240)
def test_a_failing_loop_ends_the_mlflow_run_failed_and_keeps_its_reports(
    ray_cluster, tmp_path, monkeypatch
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    uri = (tmp_path / "mlruns").as_uri()
    mlflow_cb = MLflowLoggerCallback(uri)
    with pytest.raises(TrainingFailedError, match="the loop fails on purpose"):
        _fit(tmp_path, "failing", [mlflow_cb], fail_at=4)
    run = MlflowClient(tracking_uri=uri).get_run(mlflow_cb.run_id)
    assert run.info.status == "FAILED"
    history = MlflowClient(tracking_uri=uri).get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == [1, 2, 3]


@pytest.mark.timeout(240)
def test_tbx_uploads_through_a_non_local_run_filesystem(ray_cluster, tmp_path):
    import fsspec
    import pyarrow.fs as pafs

    # a local folder seen through fsspec: not pyarrow's LocalFileSystem, so the run is
    # "remote" and the event file goes through the filesystem (as to s3://)
    root = tmp_path / "bucket"
    root.mkdir()
    fs = pafs.PyFileSystem(pafs.FSSpecHandler(fsspec.filesystem("file")))
    callback = TBXLoggerCallback()
    result = RingTrainer(
        _loop,
        train_loop_config={"reports": 3},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="remote",
            storage_path=str(root),
            storage_filesystem=fs,
            callbacks=[callback],
            verbose=0,
        ),
    ).fit()
    scalars = read_scalars(result.path)
    assert [step for step, _ in scalars["acc"]] == [1, 2, 3]


def test_progress_is_a_run_config_switch_and_ring_progress_0_wins(monkeypatch):
    assert _progress.progress_callback(RunConfig(), "r") is not None
    assert _progress.progress_callback(RunConfig(progress=False), "r") is None
    assert _progress.progress_callback(RunConfig(verbose=0), "r") is None
    monkeypatch.setenv("RING_PROGRESS", "0")
    assert _progress.progress_callback(RunConfig(), "r") is None
    with pytest.raises(ValueError, match=r"RunConfig.progress must be True or False, got 'yes'"):
        RunConfig(progress="yes")


def test_the_callbacks_refuse_bad_arguments_naming_them():
    with pytest.raises(ValueError, match=r"MLflowLoggerCallback\(save_artifact='y'\)"):
        MLflowLoggerCallback(save_artifact="y")
    with pytest.raises(ValueError, match=r"MLflowLoggerCallback\(experiment_name=''\)"):
        MLflowLoggerCallback(experiment_name="")
    with pytest.raises(ValueError, match=r"TBXLoggerCallback\(logdir=3\)"):
        TBXLoggerCallback(3)


def test_a_terminal_gets_one_bar_with_the_reports_lines_above_it():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    out = Terminal()
    callback = _progress.ProgressCallback(verbose=1, out=out)
    callback.on_start(name="r", path="/p", config=None)
    for i in range(1, 4):
        callback.on_report({"loss": 1.0 / i}, None)
    callback.on_end(None)
    text = out.getvalue()
    assert callback.display.kind == "tty"
    assert "[RingTrainer] iteration 3: loss=0.3333" in text
    assert "loss=0.3333" in text.rsplit("\r", 1)[-1]  # the bar's last draw shows the last report
