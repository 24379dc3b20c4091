"""estimators: LightningModules, callbacks, MLflow, rows once per epoch, resume after a
worker was SIGKILLed (Spark retries the barrier stage), batched transform, clear errors.

One SparkSession, ``local[2,2]``: 2 slots, and Spark retries a failed task (so a barrier
stage whose worker died is rerun once, with RING_SPARK_ATTEMPT=1).
"""

from __future__ import annotations

import glob
import io
import json
import os
import signal
import uuid

import numpy as np
import pytest
import torch
from _digits import demo
from _reliability import record
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, DoubleType

import spark_runner
from estimators import Callback, RingEstimator, RingModel, Store

pytestmark = [pytest.mark.spark, pytest.mark.slow]


@pytest.fixture(scope="module")
def spark():
    session = spark_runner.local_session(
        "local[2,2]",
        app_name="test-estimators-training",
        conf={
            "spark.sql.shuffle.partitions": "2",
            "spark.stage.maxConsecutiveAttempts": "2",
            "spark.sql.execution.arrow.maxRecordsPerBatch": "50",
        },
    )
    try:
        session.sparkContext.setLogLevel("FATAL")
        yield session
    finally:
        session.stop()


@pytest.fixture(scope="module")
def digits(spark):
    return demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)


# Classes are made inside functions so cloudpickle ships them by value to the workers.


def _digits_module():
    import lightning.pytorch as pl

    class DigitsModule(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
            )

        def forward(self, x):
            return self.net(x)

        def _step(self, batch):
            logits = self(batch["features"])
            label = batch["label"].long()
            loss = torch.nn.functional.cross_entropy(logits, label)
            return loss, (logits.argmax(dim=1) == label).float().mean()

        def training_step(self, batch, batch_idx):
            loss, acc = self._step(batch)
            self.log("acc", acc)
            return loss

        def validation_step(self, batch, batch_idx):
            loss, acc = self._step(batch)
            self.log("val_acc", acc)
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=3e-3)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.8)
            return {"optimizer": opt, "lr_scheduler": sched}

    torch.manual_seed(demo.SEED)
    return DigitsModule()


@pytest.mark.timeout(180)
def test_lightning_module_trains_on_digits_with_its_own_steps_and_logs_to_mlflow(
    digits, tmp_path, monkeypatch
):
    import mlflow

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # a local file tracking store

    train_df, test_df = digits
    store = Store.create(str(tmp_path / "store"))
    estimator = RingEstimator(
        model=_digits_module(),
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=3,
        num_proc=2,
        validation=0.1,
        store=store,
        random_seed=demo.SEED,
        run_id="lightning",
        inmemory_cache_all=True,
        verbose=0,
    )
    previous = mlflow.get_tracking_uri()
    mlflow.set_tracking_uri("file://" + str(tmp_path / "mlruns"))
    try:
        with mlflow.start_run() as run:
            fitted = estimator.fit(train_df)
        client = mlflow.tracking.MlflowClient()
        losses = client.get_metric_history(run.info.run_id, "train_loss")
        params = client.get_run(run.info.run_id).data.params
    finally:
        mlflow.set_tracking_uri(previous)

    history = fitted.getHistory()
    assert [e["epoch"] for e in history] == [1, 2, 3]
    assert {"train_loss", "train_acc", "val_loss", "val_acc"} <= set(history[-1])
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    assert history[-1]["val_acc"] > 0.85
    assert demo.held_out_accuracy(fitted, test_df) > 0.85
    assert type(fitted.getModel()).__name__ == "DigitsModule"
    assert fitted.getRunId() == "lightning"
    assert store.read_json(store.get_history_path("lightning")) == history
    checkpoint = torch.load(store.get_checkpoint_path("lightning"), weights_only=True)
    trainer_state = torch.load(io.BytesIO(checkpoint["lightning"]), weights_only=True)
    assert trainer_state["lr_schedulers"][0]["last_epoch"] == 3  # StepLR stepped once per epoch
    assert trainer_state["global_step"] > 0 and trainer_state["global_step"] % 3 == 0
    assert [m.step for m in losses] == [1, 2, 3]
    assert [m.value for m in losses] == pytest.approx([e["train_loss"] for e in history])
    assert params["ringtrain.framework"] == "lightning"
    assert params["ringtrain.run_id"] == "lightning"


def test_lightning_params_that_it_defines_itself_are_refused(digits):
    module = _digits_module()
    for extra, message in (
        ({"loss": torch.nn.CrossEntropyLoss()}, "defines its own"),
        ({"optimizer": torch.optim.SGD(module.parameters(), lr=0.1)}, "configure_optimizers"),
        ({"metrics": ["accuracy"]}, "self.log"),
    ):
        est = RingEstimator(model=module, feature_cols=["features"], label_cols=["label"], **extra)
        with pytest.raises(ValueError, match=message):
            est.fit(digits[0])


# --- callbacks, and each row once per epoch ---------------------------------------------------


def _id_frame(spark, rows):
    """``x = [row id / 1000, noise]``, ``y`` a function of the noise: the id rides along."""
    rng = np.random.default_rng(3)
    noise = rng.normal(size=rows)
    pdf = {"x": [[i / 1000, float(v)] for i, v in enumerate(noise)], "y": list(2.0 * noise)}
    import pandas as pd

    return spark.createDataFrame(pd.DataFrame(pdf))


def _recorders(out_dir):
    def record_ids(batch):
        rank = os.environ.get("RING_RANK")
        if rank is None:  # fit's first-batch check on the driver
            return batch
        with open(os.path.join(out_dir, f"ids-rank{rank}.txt"), "a") as f:
            f.write(" ".join(str(round(i * 1000)) for i in batch["x"][:, 0]) + "\n")
        return batch

    class Recorder(Callback):
        def _write(self, line):
            with open(os.path.join(out_dir, f"ids-rank{self.rank}.txt"), "a") as f:
                f.write(line + "\n")

        def on_train_begin(self, logs):
            self.batches = 0

        def on_epoch_begin(self, epoch, logs):
            self._write(f"epoch {epoch}")

        def on_batch_end(self, batch, logs):
            assert logs["rows"] == 32 and np.isfinite(logs["loss"])
            self.batches += 1

        def on_epoch_end(self, epoch, logs):
            with open(os.path.join(out_dir, f"epochs-rank{self.rank}.jsonl"), "a") as f:
                f.write(json.dumps({"epoch": epoch, "batches": self.batches, "logs": logs}) + "\n")
            self.batches = 0

    return record_ids, Recorder()


def _ids_per_epoch(out_dir, rank):
    epochs: list[list[int]] = []
    with open(os.path.join(out_dir, f"ids-rank{rank}.txt")) as f:
        for line in f:
            if line.startswith("epoch"):
                epochs.append([])
            else:
                epochs[-1].extend(int(i) for i in line.split())
    return epochs


@pytest.mark.timeout(180)
def test_callbacks_see_every_batch_and_epoch_and_each_row_is_seen_once_per_epoch(spark, tmp_path):
    rows, batch, out = 1000, 32, str(tmp_path)
    record_ids, recorder = _recorders(out)
    model = torch.nn.Linear(2, 1)
    fitted = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=batch,
        epochs=2,
        num_proc=2,
        random_seed=11,
        store=str(tmp_path / "store"),
        transformation_fn=record_ids,
        callbacks=[recorder],
        train_reader_num_workers=2,
        verbose=0,
    ).fit(_id_frame(spark, rows))
    steps = rows // (batch * 2)  # the default train_steps_per_epoch
    per_rank = [_ids_per_epoch(out, r) for r in range(2)]
    for epoch in range(2):
        seen = per_rank[0][epoch] + per_rank[1][epoch]
        assert len(seen) == steps * batch * 2
        assert len(set(seen)) == len(seen)  # no row twice within an epoch
        assert rows - len(seen) < 2 * batch  # only the drop-last remainder is missing
    assert per_rank[0][0] != per_rank[0][1]  # shuffled differently each epoch
    for rank in range(2):
        with open(os.path.join(out, f"epochs-rank{rank}.jsonl")) as f:
            ends = [json.loads(line) for line in f]
        assert [e["epoch"] for e in ends] == [0, 1]
        assert all(e["batches"] == steps for e in ends)
        # the averaged metrics, the same on every rank ("seconds" is each rank's own)
        assert [{k: v for k, v in e["logs"].items() if k != "seconds"} for e in ends] == [
            {k: v for k, v in h.items() if k != "seconds"} for h in fitted.getHistory()
        ]


def test_a_callback_without_any_hook_is_refused(spark, tmp_path):
    model = torch.nn.Linear(2, 1)
    est = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        callbacks=[object()],
    )
    with pytest.raises(ValueError, match="defines none of"):
        est.fit(_id_frame(spark, 10))


# --- resume after a worker died ---------------------------------------------------------------


def _regression_frame(spark):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(640, 8))
    y = x @ rng.normal(size=8) + 0.1 * rng.normal(size=640)
    import pandas as pd

    return spark.createDataFrame(pd.DataFrame({"x": list(x), "y": y}))


def _kill_at_epoch_2(out_dir):
    class KillRankOneAtEpoch2(Callback):
        def on_train_begin(self, logs):
            attempt = os.environ.get(spark_runner.ATTEMPT_ENV_VAR, "0")
            with open(os.path.join(out_dir, f"begin-rank{self.rank}-attempt{attempt}"), "w") as f:
                f.write(str(logs["start_epoch"]))

        def on_epoch_begin(self, epoch, logs):
            self.epoch = epoch

        def on_batch_end(self, batch, logs):
            attempt = os.environ.get(spark_runner.ATTEMPT_ENV_VAR, "0")
            # After the first step of epoch 2 (0-based), rank 0 has written the checkpoint
            # of epoch 1: the gradient allreduce of that step waited for it.
            if attempt == "0" and self.rank == 1 and self.epoch == 2 and batch == 0:
                os.kill(os.getpid(), signal.SIGKILL)

    return KillRankOneAtEpoch2()


def _resumable(store, run_id, callbacks):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    return RingEstimator(
        model=model,
        optimizer=torch.optim.Adam(model.parameters(), lr=0.01),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=16,
        epochs=4,
        num_proc=2,
        random_seed=21,
        store=store,
        run_id=run_id,
        callbacks=callbacks,
        validation=0.1,
        verbose=0,
    )


@pytest.mark.reliability(
    fault="a worker process SIGKILLed at epoch 2 of 4 (Spark stage retry)", category="fault"
)
@pytest.mark.timeout(300)
def test_a_worker_killed_at_epoch_2_resumes_at_epoch_3_on_spark_retry_with_optimizer_state(
    spark, tmp_path, request
):
    df = _regression_frame(spark).cache()
    store = Store.create(str(tmp_path / "store"))
    marks = str(tmp_path / "marks")
    os.makedirs(marks)
    resumed = _resumable(store, "killed", [_kill_at_epoch_2(marks)]).fit(df)
    reference = _resumable(store, "whole", []).fit(df)

    begins = {}
    for path in glob.glob(os.path.join(marks, "*")):
        with open(path) as f:
            begins[os.path.basename(path)] = int(f.read())
    assert begins == {
        "begin-rank0-attempt0": 0,
        "begin-rank1-attempt0": 0,
        "begin-rank0-attempt1": 2,  # epochs 1-2 done: the retry starts at epoch 3
        "begin-rank1-attempt1": 2,
    }
    history = resumed.getHistory()
    assert [e["epoch"] for e in history] == [1, 2, 3, 4]  # each epoch once
    for mine, theirs in zip(history, reference.getHistory(), strict=True):
        assert mine["train_loss"] == pytest.approx(theirs["train_loss"], rel=1e-4)
        assert mine["val_loss"] == pytest.approx(theirs["val_loss"], rel=1e-4)
    for (name, a), (_, b) in zip(
        resumed.getModel().state_dict().items(),
        reference.getModel().state_dict().items(),
        strict=True,
    ):
        assert torch.allclose(a, b, atol=1e-5), name
    # no half-written checkpoint is left next to the real one and the one before it
    # (writer.json: the attempt that owns the run's checkpoints, Store.claim_run)
    run_dir = store.get_checkpoints_path("killed")
    assert sorted(os.listdir(run_dir)) == ["checkpoint.pt", "checkpoint.pt.prev", "writer.json"]
    record(
        request,
        note="retry resumed at epoch 3 from the epoch-2 checkpoint; weights as uninterrupted",
    )


# --- RingModel.transform: batched, model loaded once per task ------------------------------------


def _counting_model(out_dir):
    class Counting(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 3)

        def __setstate__(self, state):  # runs when a task unpickles the model
            super().__setstate__(state)
            open(os.path.join(out_dir, f"load-{uuid.uuid4().hex}"), "w").close()

        def forward(self, x):
            open(os.path.join(out_dir, f"batch-{uuid.uuid4().hex}"), "w").close()
            out = self.linear(x)
            return out[:, :1], out

    return Counting()


@pytest.mark.timeout(120)
def test_transform_loads_the_model_once_per_task_and_types_outputs_by_shape(spark, tmp_path):
    out = str(tmp_path)
    model = RingModel(
        model=_counting_model(out),
        feature_cols=["x"],
        label_cols=["a", "b"],
        feature_shapes=[[4]],
        history=[{"epoch": 1, "train_loss": 0.5}],
        run_id="r1",
    ).setOutputCols(["score", "logits"])
    rows = 1000
    df = (
        spark.range(rows)
        .select("id", F.array(*[F.rand(seed=i) for i in range(4)]).alias("x"))
        .repartition(2)
    )
    result = model.transform(df)
    assert result.schema["score"].dataType == DoubleType()
    assert result.schema["logits"].dataType == ArrayType(DoubleType(), False)
    for name in glob.glob(os.path.join(out, "*")):  # the schema probe ran on the driver
        os.remove(name)
    got = result.select("id", "x", "score", "logits").collect()
    loads = glob.glob(os.path.join(out, "load-*"))
    batches = glob.glob(os.path.join(out, "batch-*"))
    assert len(got) == rows
    assert len(loads) == df.rdd.getNumPartitions() == 2  # once per task
    assert len(batches) >= rows // 50  # Arrow batches of at most 50 rows
    first = got[0]
    expect = model.getModel().linear(torch.tensor([first["x"]], dtype=torch.float32))[0]
    assert first["logits"] == pytest.approx(expect.tolist(), rel=1e-5)
    assert first["score"] == pytest.approx(expect[0].item(), rel=1e-5)
    assert model.getHistory() == [{"epoch": 1, "train_loss": 0.5}]
    assert model.getRunId() == "r1"


# --- the anchor's known failures -------------------------------------------------------------------


def test_a_model_that_does_not_fit_the_features_fails_before_the_job_naming_shapes(digits):
    model = torch.nn.Linear(10, 10)  # the digits have 64 features
    est = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        num_proc=2,
    )
    with pytest.raises(ValueError, match=r"Linear failed on a first batch.*shape \(2, 64\)"):
        est.fit(digits[0])


def test_a_memory_store_is_refused_by_fit_with_the_stores_that_work(digits):
    model = torch.nn.Linear(64, 10)
    est = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        store=Store.create(f"memory://fit-{uuid.uuid4().hex[:6]}"),
    )
    with pytest.raises(ValueError, match="s3://, gs://"):
        est.fit(digits[0])


def test_reader_auto_falls_back_to_arrow_when_the_stack_breaks_petastorm(monkeypatch, digits):
    from ringcore import _stackcheck
    from ringcore.data import resolve_reader

    monkeypatch.setattr(_stackcheck, "check", lambda: ["petastorm needs pyarrow < 15"])
    assert resolve_reader("auto") == "arrow"
    model = torch.nn.Linear(64, 10)
    est = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
        reader="petastorm",
    )
    with pytest.raises(ValueError, match=r"pyarrow < 15.*setReader\('arrow'\)"):
        est.fit(digits[0])
    assert RingEstimator().getReader() == "auto"


def test_use_gpu_is_auto_and_true_without_cuda_is_refused(digits):
    from estimators.fit._resolve import resolve_config

    model = torch.nn.Linear(64, 10)
    est = RingEstimator(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.CrossEntropyLoss(),
        feature_cols=["features"],
        label_cols=["label"],
    )
    assert resolve_config(est, digits[0]).use_gpu == torch.cuda.is_available()
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="use_gpu=True but torch sees no CUDA"):
            resolve_config(est.copy({est.use_gpu: True}), digits[0])
