"""Live progress on the driver: ringcore.progress's display, RingEstimator.fit (real Spark
local[2], real Gloo) and spark_runner.run with a function that reports progress."""

from __future__ import annotations

import io
import logging
import re
import sys
import time

import _spark
import pytest
import torch
from _digits import demo

import spark_runner
from estimators import RingEstimator, Store
from ringcore.progress import ProgressDisplay, format_progress, progress_enabled
from spark_runner import _run as spark_run

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

EPOCHS = 2


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


# --- the display -------------------------------------------------------------------------


def test_plain_lines_come_at_most_once_per_interval():
    out = io.StringIO()
    display = ProgressDisplay(out)
    assert display.kind == "plain"
    for step in range(1, 51):
        display.update({"step": step, "total": 50, "loss": 1.0 / step})
    lines = out.getvalue().splitlines()
    assert display.updates == 50
    assert lines == ["step 1/50  loss 1.0000"]  # the next may only come PLAIN_INTERVAL_S later


def test_a_flush_prints_the_latest_progress_the_plain_lines_skipped_once():
    out = io.StringIO()
    display = ProgressDisplay(out)
    for step in range(1, 51):
        display.update({"step": step, "total": 50})
    display.flush()
    display.flush()  # once
    display.close()
    assert out.getvalue().splitlines() == ["step 1/50", "step 50/50"]
    shown = io.StringIO()
    display = ProgressDisplay(shown)
    display.update({"step": 1, "total": 2})
    display.flush()  # its line is out already
    assert shown.getvalue().splitlines() == ["step 1/2"]


def test_a_terminal_gets_a_tqdm_bar_with_epoch_loss_and_throughput():
    out = _Terminal()
    display = ProgressDisplay(out)
    assert display.kind == "tty"
    display.update(
        {"epoch": 2, "epochs": 3, "step": 5, "steps": 10, "loss": 0.25, "rows_per_s": 640}
    )
    display.write("epoch 1/3  train_loss 0.3000")
    display.close()
    text = out.getvalue()
    assert "\r" in text and "15/30" in text  # epoch 2's step 5 of 3 x 10 steps
    assert "loss=0.2500" in text and "rows/s=640" in text and "epoch=2/3" in text
    assert "epoch 1/3  train_loss 0.3000" in text


def test_format_progress_shows_epoch_step_loss_metrics_and_rates():
    line = format_progress(
        {
            "epoch": 1,
            "epochs": 2,
            "step": 3,
            "steps": 4,
            "loss": 0.5,
            "lr": 0.01,
            "rows_per_s": 99.6,
        }
    )
    assert line == "epoch 1/2  step 3/4  loss 0.5000  lr 0.01  100 rows/s"
    assert format_progress({"step": 7, "total": None, "steps_per_s": 2.5}) == "step 7  2.50 steps/s"


def test_ring_progress_env_turns_every_display_off_and_rejects_a_non_switch(monkeypatch):
    assert progress_enabled(True) and progress_enabled(None) and not progress_enabled(False)
    monkeypatch.setenv("RING_PROGRESS", "0")
    assert not progress_enabled(True)
    monkeypatch.setenv("RING_PROGRESS", "maybe")
    with pytest.raises(ValueError, match=r"RING_PROGRESS='maybe'.*set it to 0"):
        progress_enabled(True)


def test_progress_is_an_estimator_param_on_by_default():
    estimator = RingEstimator()
    assert estimator.getProgress() is True
    assert estimator.setProgress(False).getProgress() is False


# --- real runs -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    return session


_PLAIN = re.compile(r"^epoch (\d+)/2  step (\d+)/(\d+)  loss \d+\.\d{4}  \d+ rows/s$", re.MULTILINE)


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_fit_shows_rank_0_steps_loss_and_rows_per_second_a_few_times_a_second_before_its_end(
    spark, tmp_path, monkeypatch
):
    monkeypatch.setattr(ProgressDisplay, "plain_interval_s", 0.0)  # every update as a line
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as a script with no logging set
    both = io.StringIO()  # stdout and stderr as one terminal shows them: in order
    monkeypatch.setattr(sys, "stdout", both)
    monkeypatch.setattr(sys, "stderr", both)
    torch.manual_seed(demo.SEED)
    model = torch.nn.Linear(64, 10)
    estimator = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=16,
        epochs=EPOCHS,
        num_proc=2,
        store=Store.create(str(tmp_path / "store")),
        run_id="progress",
        random_seed=demo.SEED,
        inmemory_cache_all=True,
    )
    df = demo.digits_frame(spark).limit(640)
    started = time.monotonic()
    fitted = estimator.fit(df)
    elapsed = time.monotonic() - started
    out = both.getvalue()

    matches = [tuple(int(g) for g in m) for m in _PLAIN.findall(out)]
    steps = matches[0][2]
    assert all(1 <= step <= total == steps for _, step, total in matches)
    assert [m[:2] for m in matches] == sorted(m[:2] for m in matches)  # steps in order
    lines = out.splitlines()
    for epoch in range(1, EPOCHS + 1):  # an epoch's steps before its line, the next's after
        at = next(i for i, line in enumerate(lines) if line.startswith(f"epoch {epoch}/2  train"))
        shown = [_PLAIN.match(line) for line in lines]
        assert all(int(m.group(1)) > epoch for m in shown[at:] if m), lines
    # the driver reads the progress file every 0.3 s: no more lines than polls
    assert len(matches) <= elapsed / 0.3 + 2
    assert "epoch 2/2  train_loss" in out  # the per-epoch lines are still there
    assert len(fitted.getHistory()) == EPOCHS
    # every epoch's line and every progress line before the fit's end line, which is last
    end = [i for i, line in enumerate(lines) if "[ringtrain] fit finished on 2 workers" in line]
    last = max(i for i, line in enumerate(lines) if line.startswith("epoch "))
    assert len(end) == 1 and end[0] > last, lines[-8:]
    assert "Spark barrier tasks" not in out  # the stage's own lines: DEBUG under a fit


def _reporting_fn(steps: int) -> int:
    import ringcore
    import spark_runner

    ringcore.init()
    for step in range(1, steps + 1):
        spark_runner.progress(step=step, total=steps, loss=1.0 / step, lr=0.5)
    return ringcore.rank()


@pytest.mark.spark
@pytest.mark.timeout(180)
def test_run_shows_rank_0_progress_rate_limited_and_its_launch_lines_without_logging(
    spark, capsys, monkeypatch
):
    monkeypatch.setattr(ProgressDisplay, "plain_interval_s", 0.0)
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # as a script with no logging set
    out = io.StringIO()
    steps = 400
    assert spark_runner.run(_reporting_fn, args=(steps,), num_proc=2, stdout=out) == [0, 1]
    lines = [line for line in out.getvalue().splitlines() if line.startswith("step ")]
    assert lines[-1].startswith(f"step {steps}/{steps}  loss 0.0025  lr 0.5")
    assert "steps/s" in lines[-1]
    assert len(lines) < steps  # one rank's reports, at most one per 0.3 s but the last
    err = capsys.readouterr().err
    assert err.count("[ringtrain] launching _reporting_fn on 2 Spark barrier tasks") == 1
    assert err.count("[ringtrain] _reporting_fn finished on 2 ranks") == 1


def test_launch_lines_go_through_logging_alone_once_it_is_configured(capsys, monkeypatch):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    monkeypatch.setattr(logging.getLogger(), "handlers", [handler])
    previous = spark_run.log.level
    spark_run.log.setLevel(logging.INFO)  # setLevel, not setattr: it clears the level cache
    try:
        spark_run._say(1, 1, "launching %s on %d Spark barrier tasks", "fn", 2)
    finally:
        spark_run.log.setLevel(previous)
    assert stream.getvalue() == "launching fn on 2 Spark barrier tasks\n"
    assert "launching" not in capsys.readouterr().err


def test_progress_outside_a_task_does_nothing_and_checks_its_arguments():
    spark_runner.progress(step=3, total=10, loss=0.5)  # no driver: no error, no output
    with pytest.raises(TypeError, match=r"progress\(step=...\) takes an integer >= 0, got -1"):
        spark_runner.progress(step=-1)
    with pytest.raises(TypeError, match=r"progress\(loss=...\) takes a finite number, got nan"):
        spark_runner.progress(step=1, loss=float("nan"))
