"""estimators: the torch loop's knobs (issue 23) in real fits, and a saveable estimator.

One SparkSession ``local[2]``, a 64-row DataFrame, three fits:

- loss_weights + train_minibatch_fn + an epoch StepLR + early stopping on a monitor +
  restore_best_weights + backend_env, on two label columns;
- bf16 autocast + gradient clipping + a per-step scheduler given as a factory;
- an unfitted estimator in a Pipeline, saved and loaded.
"""

from __future__ import annotations

import glob
import json
import os
import pathlib
import threading

import _spark
import numpy as np
import pytest
import torch
from pyspark.ml import Pipeline
from pyspark.sql import functions as F

from estimators import Callback, RingEstimator, Store

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

pytestmark = [pytest.mark.spark]


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    session.sparkContext.setLogLevel("FATAL")
    return session


@pytest.fixture(scope="module")
def frame(spark):
    rng = np.random.default_rng(7)
    xs = rng.uniform(-1, 1, 64)
    rows = [(float(x), float(2 * x + 1), float(-x), i % 4 == 0) for i, x in enumerate(xs)]
    return spark.createDataFrame(rows, ["x", "y1", "y2", "is_val"])


# Classes made inside functions travel to the workers by value (cloudpickle).


def _two_heads():
    class TwoHeads(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)

        def forward(self, x):
            return self.a(x), self.b(x)

    torch.manual_seed(0)
    return TwoHeads()


def _autocast_probe():
    class Probe(torch.nn.Module):
        """A Linear that records in a buffer whether its forward ran under autocast."""

        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(1, 1)
            self.register_buffer("autocast_seen", torch.zeros(()))

        def forward(self, x):
            if torch.is_autocast_enabled("cpu"):
                self.autocast_seen.fill_(1.0)
            return self.lin(x)

    torch.manual_seed(0)
    return Probe()


def _recorder(folder):
    class _Recorder(Callback):
        """Writes, per rank, the epochs it ran, an env var it saw and rank 0's parameters
        after every optimizer step, into ``folder``."""

        def __init__(self, folder):
            self.folder = folder
            self.seen = {"epochs": [], "env": None, "params": []}

        def _flat(self):
            return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()]).tolist()

        def on_train_begin(self, logs):
            self.seen["env"] = os.environ.get("RINGTRAIN_KNOB_TEST")
            self.seen["params"].append(self._flat())

        def on_batch_end(self, batch, logs):
            self.seen["params"].append(self._flat())

        def on_epoch_end(self, epoch, logs):
            self.seen["epochs"].append(epoch)

        def on_train_end(self, logs):
            with open(os.path.join(self.folder, f"rank{self.rank}.json"), "w") as f:
                json.dump(self.seen, f)

    return _Recorder(folder)


def _read_ranks(folder):
    return [json.loads(p.read_text()) for p in sorted(pathlib.Path(folder).glob("rank*.json"))]


def _minibatch_fn(folder):
    def train_minibatch(
        model, optimizer, transform_outputs, loss_fn, inputs, labels, sample_weights,
        backward_passes_per_step, batch_idx,
    ):  # fmt: skip
        with open(os.path.join(folder, f"calls.{os.getpid()}"), "a") as f:
            f.write(f"{batch_idx}\n")
        if batch_idx % backward_passes_per_step == 0:
            if batch_idx != 0:
                optimizer.step()
            optimizer.zero_grad()
        outputs, labels = transform_outputs(model(*inputs), labels)
        loss = loss_fn(outputs, labels, sample_weights)
        loss.backward()
        return outputs, loss

    return train_minibatch


def test_weights_schedule_early_stopping_best_weights_and_env(frame, tmp_path):
    model = _two_heads()
    head_b = [p.detach().clone() for p in model.b.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    est = RingEstimator(
        num_proc=2,
        model=model,
        optimizer=optimizer,
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y1", "y2"],
        validation="is_val",
        batch_size=8,
        epochs=6,
        train_steps_per_epoch=2,
        random_seed=1,
        verbose=0,
        store=Store.create(str(tmp_path / "store")),
        loss_weights=[1.0, 0.0],  # the second head's loss counts for nothing
        train_minibatch_fn=_minibatch_fn(str(tmp_path)),
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5),
        monitor="val_loss",
        monitor_mode="max",  # training lowers val_loss: the first epoch is the "best"
        early_stopping_patience=1,
        backend_env={"RINGTRAIN_KNOB_TEST": "on"},
        callbacks=[_recorder(str(tmp_path))],
    )
    trained = est.fit(frame)
    history = trained.getHistory()
    val = [e["val_loss"] for e in history]
    best = int(np.argmax(val))
    # stopped `patience` epochs after the best, well before epochs=6, on every rank
    assert len(history) == best + 2 < 6 and history[-1]["stopped_early"] is True
    ranks = _read_ranks(tmp_path)
    assert [r["epochs"] for r in ranks] == [list(range(len(history)))] * 2
    assert [r["env"] for r in ranks] == ["on", "on"] and "RINGTRAIN_KNOB_TEST" not in os.environ
    # StepLR(gamma=0.5) per epoch: the lr each epoch trained with
    assert [e["lr"] for e in history] == pytest.approx([0.2 * 0.5**i for i in range(len(history))])
    # train_minibatch_fn ran every training step of every rank
    calls = [pathlib.Path(p).read_text().split() for p in glob.glob(str(tmp_path / "calls.*"))]
    assert sum(len(c) for c in calls) == 2 * 2 * len(history)
    # the returned model is the best epoch's; its weighted val loss, by hand, is that epoch's
    rows = frame.filter(F.col("is_val")).toPandas()
    x = torch.tensor(rows["x"].values, dtype=torch.float32).view(-1, 1)
    y1, y2 = (torch.tensor(rows[c].values, dtype=torch.float32).view(-1, 1) for c in ("y1", "y2"))
    with torch.no_grad():
        o1, o2 = trained.getModel()(x)
        mse = torch.nn.functional.mse_loss
        by_hand = float(mse(o1, y1) + 0.0 * mse(o2, y2))
        unweighted = float(mse(o1, y1) + mse(o2, y2))
    assert by_hand == pytest.approx(val[best], rel=1e-4)
    assert unweighted != pytest.approx(val[best], rel=1e-2)
    assert val[best] != pytest.approx(val[-1], rel=1e-3)  # the last epoch's model differs
    assert all(torch.equal(a, b) for a, b in zip(head_b, trained.getModel().b.parameters()))


def test_bf16_autocast_and_clipping_after_the_allreduce_with_a_per_step_schedule(frame, tmp_path):
    model = _autocast_probe()
    est = RingEstimator(
        num_proc=2,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y1"],
        batch_size=8,
        epochs=2,
        train_steps_per_epoch=2,
        random_seed=1,
        verbose=0,
        store=Store.create(str(tmp_path / "store")),
        precision="bf16-mixed",
        gradient_clip_val=0.01,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
        lr_scheduler_interval="step",
        callbacks=[_recorder(str(tmp_path))],
    )
    trained = est.fit(frame)
    assert float(trained.getModel().autocast_seen) == 1.0  # the forward ran under autocast
    # lr of the epoch's last step: 1, 0.5 | 0.25, 0.125
    assert [e["lr"] for e in trained.getHistory()] == pytest.approx([0.5, 0.125])
    # every step moved the weights by lr * 0.01 exactly: the averaged gradient clipped to
    # norm 0.01 (far below its raw norm) on every rank, so the replicas stay equal
    ranks = _read_ranks(tmp_path)
    params = np.array(ranks[0]["params"])
    steps = np.linalg.norm(np.diff(params, axis=0), axis=1)
    assert steps == pytest.approx([0.01, 0.005, 0.0025, 0.00125], rel=1e-3)
    assert ranks[0]["params"] == ranks[1]["params"]


def test_knobs_are_refused_before_any_job(frame, tmp_path):
    model = torch.nn.Linear(1, 1)
    base = dict(
        num_proc=2,
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y1"],
        store=Store.create(str(tmp_path / "store")),
    )
    cases = [
        ({"precision": "16"}, r"precision='16'.*needs CUDA.*'bf16'"),
        ({"early_stopping_patience": 2}, r"monitor='val_loss' needs validation data"),
        ({"early_stopping_patience": 2, "validation": 0.25, "monitor": "val_acc"}, r"val_acc.*not a metric.*val_loss"),
        ({"loss_weights": [1.0, 2.0]}, r"loss_weights has 2 entries but label_cols names 1"),
        ({"gradient_clip_val": -1.0}, r"gradient_clip_val must be a positive number"),
        ({"lr_scheduler_interval": "batch"}, r"lr_scheduler_interval takes 'epoch' or 'step'"),
        ({"custom_objects": {"x": 1}}, r"custom_objects=.*Keras"),
        ({"checkpoint_callback": object()}, r"checkpoint_callback=.*Keras.*restore_best_weights"),
        ({"train_minibatch_fn": _minibatch_fn("/tmp"), "gradient_clip_val": 1.0}, r"train_minibatch_fn.*gradient_clip_val"),
        ({"reader_pool_type": "fork"}, r"reader_pool_type must be one of 'thread', 'process', 'dummy'; got 'fork'.*setReaderPoolType"),
        ({"reader_pool_type": "process", "reader": "arrow"}, r"'process' is petastorm's process pool, but reader='arrow'.*setReaderPoolType\('thread'\)"),
        ({"partitions_per_process": 0}, r"partitions_per_process.*setPartitionsPerProcess"),
        ({"val_reader_num_workers": 0}, r"val_reader_num_workers.*setValReaderNumWorkers"),
    ]  # fmt: skip
    for extra, message in cases:
        with pytest.raises(ValueError, match=message):
            RingEstimator(**{**base, **extra}).fit(frame)
    assert not os.path.exists(tmp_path / "store" / "intermediate_train_data.0")


@pytest.mark.parametrize(
    ("reader", "pool"), [("arrow", "thread"), ("petastorm", "process"), ("petastorm", "dummy")]
)
def test_horovods_reader_params_shape_the_files_and_drive_both_readers(
    frame, tmp_path, reader, pool
):
    """partitions_per_process writes num_proc x it files of each split; the pool and the
    readers' worker counts reach both readers (petastorm's process pool included) and
    the fit learns the same line as with the defaults."""
    model = torch.nn.Linear(1, 1)
    store = Store.create(str(tmp_path / "store"))
    trained = RingEstimator(
        num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.2),
        loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y1"], validation="is_val",
        batch_size=4, epochs=3, random_seed=3, verbose=0, store=store, reader=reader,
        partitions_per_process=3, reader_pool_type=pool, train_reader_num_workers=2,
        val_reader_num_workers=2,
    ).fit(frame)  # fmt: skip
    for split in ("train", "val"):
        files = glob.glob(str(tmp_path / "store" / f"intermediate_{split}_data.0" / "*.parquet"))
        assert len(files) == 2 * 3, (split, files)
    history = trained.getHistory()
    assert len(history) == 3 and history[-1]["val_loss"] < history[0]["val_loss"]
    assert all(np.isfinite(e["val_loss"]) for e in history)


def test_an_unfitted_estimator_in_a_pipeline_saves_and_loads(spark, tmp_path):
    model = _two_heads()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.003)
    est = RingEstimator(
        model=model,
        optimizer=optimizer,
        loss=torch.nn.MSELoss(),
        feature_cols=["x"],
        label_cols=["y1", "y2"],
        batch_size=4,
        loss_weights=[1.0, 2.0],
        lr_scheduler=torch.optim.lr_scheduler.StepLR(optimizer, step_size=2),
        store=Store.create(str(tmp_path / "store")),
        backend_env={"A": "b"},
    )
    path = str(tmp_path / "pipeline")
    Pipeline(stages=[est]).save(path)
    (loaded,) = Pipeline.load(path).getStages()
    assert isinstance(loaded, RingEstimator) and loaded.uid == est.uid
    for name in ("feature_cols", "label_cols", "batch_size", "loss_weights", "backend_env"):
        assert loaded.getOrDefault(name) == est.getOrDefault(name), name
    assert loaded.getStore().prefix_path == est.getStore().prefix_path
    got = loaded.getModel().state_dict()
    assert all(torch.equal(v, got[k]) for k, v in model.state_dict().items())
    opt = loaded.getOptimizer()
    assert type(opt) is torch.optim.Adam and opt.param_groups[0]["lr"] == 0.003
    assert {id(p) for p in opt.param_groups[0]["params"]} == {
        id(p) for p in loaded.getModel().parameters()
    }  # the optimizer still drives the loaded model
    assert loaded.getLrScheduler().optimizer is opt
    assert not loaded.isSet("epochs")  # unset params stay unset

    class Locked(Callback):
        lock = None

        def __init__(self):
            self.lock = threading.Lock()

    with pytest.raises(ValueError, match=r"callbacks.*cannot be pickled.*setCallbacks"):
        est.copy({est.callbacks: [Locked()]}).write().save(str(tmp_path / "bad"))


def test_the_migration_guide_lists_every_estimator_param_with_its_counterparts():
    from estimators._params import ESTIMATOR_PARAMS

    docs = pathlib.Path(__file__).resolve().parents[2] / "docs" / "migrating-from-horovod.md"
    header = "| ringtrain param (default) | Horovod | Ray Train / Lightning | what it does |"
    lines = docs.read_text().split(header + "\n")[1].splitlines()[1:]
    rows = {}  # | `name` (`default`) | Horovod | Ray Train / Lightning | what it does |
    for line in lines[: lines.index("")]:
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        rows[cells[0].split("`")[1]] = cells
    missing = [p.name for p in ESTIMATOR_PARAMS if p.name not in rows]
    assert missing == [], "add them to the table of every RingEstimator param in that page"
    for param in ESTIMATOR_PARAMS:
        first, horovod, ray, what = rows[param.name]
        assert first == f"`{param.name}` (`{param.default!r}`)", (first, param.default)
        assert horovod and ray and what, rows[param.name]  # "—" where there is none
