"""RingEstimator(strategy='ddp' | 'fsdp'): the digits learned under each, fsdp's sharded
checkpoints on S3 resumed on fewer workers, and the bad input refused before any job.

On the suite's shared ``local[2]`` session; S3 is moto's server on 127.0.0.1.
"""

from __future__ import annotations

import io
import os
import uuid

import _spark
import numpy as np
import pytest
import torch
from _digits import demo
from _servers import moto_s3_server

from estimators import Callback, RingEstimator, RingModel, Store
from estimators.frameworks.lightning._trainer_args import to_trainer_args

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)
BUCKET = "ringtrain-strategies"
EPOCHS = 3  # the demo's MLP (Adam, lr 1e-2) passes 0.9 held-out accuracy by then


def _digits_estimator(store: Store, epochs: int, strategy: str) -> RingEstimator:
    estimator = demo.make_estimator(store, epochs=epochs)
    optimizer = torch.optim.Adam(estimator.getModel().parameters(), lr=1e-2)
    return estimator.setOptimizer(optimizer).setStrategy(strategy).setVerbose(0).setProgress(False)


@pytest.fixture(scope="module")
def spark():
    import _spark

    return _spark.shared_session()  # never stopped here: see tests/_spark.py


@pytest.fixture(scope="module")
def digits(spark):
    return demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)


@pytest.fixture(scope="module")
def s3():
    import s3fs

    with moto_s3_server() as options:
        s3fs.S3FileSystem(**options).mkdir(BUCKET)
        yield options


def _predictions(model: RingModel, df) -> np.ndarray:
    rows = model.transform(df).select("label__output").collect()
    return np.array([r["label__output"] for r in rows])


def _same_after_reload(model: RingModel, df, path: str) -> None:
    model.save(path)
    loaded = RingModel.load(path)
    np.testing.assert_array_equal(_predictions(model, df), _predictions(loaded, df))


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_ddp_learns_the_digits_and_its_saved_model_predicts_the_same(digits, tmp_path):
    train, test = digits
    estimator = _digits_estimator(Store.create(str(tmp_path / "store")), EPOCHS, "ddp")
    fitted = estimator.fit(train)
    assert demo.held_out_accuracy(fitted, test) >= 0.9
    _same_after_reload(fitted, test, str(tmp_path / "saved"))


def _resumed_with_optimizer_state(epoch: int, steps: int) -> Callback:
    """A callback failing the fit unless it resumes at ``epoch`` with Adam's state of
    ``steps`` steps (made in a function: it travels to the workers by value)."""

    class Resumed(Callback):
        def set_context(self, model, optimizer, rank, size):
            self.optimizer, self.size = optimizer, size

        def on_train_begin(self, logs):
            assert logs["start_epoch"] == epoch, logs
            assert self.size == 1
            counts = {int(s["step"]) for s in self.optimizer.state.values()}
            assert counts == {steps}, f"Adam's step counts after the resume: {counts}"

    return Resumed()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_fsdp_writes_sharded_checkpoints_to_s3_and_resumes_them_on_one_worker(digits, s3, tmp_path):
    import s3fs

    train, test = digits
    store = Store.create(f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}", s3)
    first = _digits_estimator(store, EPOCHS - 1, "fsdp").setRunId("sharded")
    first.setTrainStepsPerEpoch(20).fit(train)
    # the pointer is the Store's checkpoint.pt; the weights are each rank's shard
    pointer = torch.load(io.BytesIO(store.read_bytes(store.find_checkpoint("sharded"))))
    assert "optimizer" not in pointer and pointer["epoch"] == EPOCHS - 1
    fs = s3fs.S3FileSystem(**s3)
    folder = f"{store.get_run_path('sharded')}/sharded/{pointer['sharded']}"
    fs.invalidate_cache()
    files = {os.path.basename(p) for p in fs.find(folder)}
    assert {"__0_0.distcp", "__1_0.distcp", ".metadata"} <= files, files
    # only the latest two epochs' folders are kept
    assert len(fs.ls(f"{store.get_run_path('sharded')}/sharded")) == 2

    second = _digits_estimator(store, EPOCHS, "fsdp").setNumProc(1).setRunId("sharded")
    second.setTrainStepsPerEpoch(20)
    second.setCallbacks([_resumed_with_optimizer_state(EPOCHS - 1, 20 * (EPOCHS - 1))])
    fitted = second.fit(train)
    assert [e["epoch"] for e in fitted.getHistory()] == list(range(1, EPOCHS + 1))
    assert demo.held_out_accuracy(fitted, test) >= 0.9
    _same_after_reload(fitted, test, str(tmp_path / "saved"))


@pytest.mark.spark
def test_the_loops_knobs_run_alike_under_ddp_and_fsdp(spark, tmp_path):
    """bf16 autocast, clipping, accumulation, a per-step schedule, validation and early
    stopping together: ddp and fsdp reduce the same gradients, so they train the same."""
    rng = np.random.default_rng(7)
    df = spark.createDataFrame([(float(x), float(2 * x + 1)) for x in rng.uniform(-1, 1, 128)],
                               ["x", "y"])  # fmt: skip
    histories = {}
    for strategy in ("ddp", "fsdp"):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(1, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
        fitted = RingEstimator(
            num_proc=2, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=torch.nn.MSELoss(), feature_cols=["x"], label_cols=["y"], batch_size=8,
            epochs=6, store=Store.create(str(tmp_path / strategy)), verbose=0, progress=False,
            strategy=strategy, precision="bf16-mixed", gradient_clip_val=1.0,
            backward_passes_per_step=2, validation=0.25, random_seed=1,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5),
            lr_scheduler_interval="step", early_stopping_patience=1, monitor="val_loss",
        ).fit(df)  # fmt: skip
        histories[strategy] = fitted.getHistory()
    ddp, fsdp = histories["ddp"], histories["fsdp"]
    assert 1 < len(ddp) < 6, ddp  # early stopping ended it (the schedule flattens the loss)
    assert ddp[0]["lr"] > ddp[1]["lr"] > 0 and "val_loss" in ddp[-1]
    assert [e["epoch"] for e in fsdp] == [e["epoch"] for e in ddp]
    for a, b in zip(ddp, fsdp, strict=True):
        for key in ("train_loss", "val_loss", "lr"):
            assert b[key] == pytest.approx(a[key], rel=1e-5), (key, ddp, fsdp)


# --- bad input: refused before any job --------------------------------------------------


def _fit_refused(spark, estimator: RingEstimator, df) -> str:
    return _spark.fit_refused_before_any_job(spark, estimator, df)


class _Frozen(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(64, 10).requires_grad_(False)

    def forward(self, x):
        return self.linear(x)


def _estimator(tmp_path, model=None, **params) -> RingEstimator:
    model = model or torch.nn.Linear(64, 10)
    return RingEstimator(
        model=model, optimizer=torch.optim.Adam(model.parameters()),
        loss=torch.nn.CrossEntropyLoss(), feature_cols=["features"], label_cols=["label"],
        num_proc=2, store=str(tmp_path / "store"), verbose=0, **params,
    )  # fmt: skip


def _stepped_adam() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(64, 10)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.zeros(1, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


BAD = {
    "fsdp-without-trainable-parameters": (
        {"strategy": "fsdp", "model": _Frozen()},
        ("strategy='fsdp'", "_Frozen has no trainable", "use strategy='ring'"),
    ),
    "fsdp_config-with-ddp": (
        {"strategy": "ddp", "fsdp_config": {"reshard_after_forward": False}},
        ("fsdp_config is for strategy='fsdp'", "strategy='ddp'", "drop fsdp_config"),
    ),
    "fsdp_config-unknown-key": (
        {"strategy": "fsdp", "fsdp_config": {"reshard": False}},
        ("fsdp_config", "'reshard'", "the keys are"),
    ),
    "fsdp-shard_modules-not-in-the-model": (
        {"strategy": "fsdp", "fsdp_config": {"shard_modules": ["BertLayer"]}},
        ("shard_modules", "'BertLayer'", "its module classes are"),
    ),
    "gradient_compression-with-ddp": (
        {"strategy": "ddp", "gradient_compression": "fp16"},
        ("gradient_compression='fp16'", "strategy='ddp'", "use strategy='ring'"),
    ),
    "train_minibatch_fn-with-fsdp": (
        {"strategy": "fsdp", "train_minibatch_fn": lambda *a: None},
        ("train_minibatch_fn=", "strategy='fsdp'", "use strategy='ring'"),
    ),
    "stepped-optimizer-with-fsdp": (
        {"strategy": "fsdp", "stepped": True},
        ("Adam given has stepped", "strategy='fsdp'", "pass a fresh optimizer"),
    ),
}


@pytest.mark.spark
@pytest.mark.parametrize("case", list(BAD))
def test_a_strategy_that_cannot_work_is_refused_naming_value_and_fix_before_any_job(
    spark, digits, tmp_path, case
):
    params, needles = BAD[case]
    params = dict(params)
    stepped = params.pop("stepped", False)
    estimator = _estimator(tmp_path, params.pop("model", None), **params)
    if stepped:
        model, optimizer = _stepped_adam()
        estimator.setModel(model).setOptimizer(optimizer)
    message = _fit_refused(spark, estimator, digits[0])
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"
    assert not os.path.exists(tmp_path / "store" / "runs")


def test_an_unknown_strategy_is_refused_as_it_is_set_naming_the_known_ones(tmp_path):
    with pytest.raises(ValueError, match=r"strategy='zero3' is not a known strategy; use one of "
                       r"'ring', 'ddp', 'fsdp'"):  # fmt: skip
        _estimator(tmp_path, strategy="zero3")
    with pytest.raises(ValueError, match="strategy='zero3'"):
        _estimator(tmp_path).setStrategy("zero3")


def test_lightnings_fsdp_is_refused_as_it_is_set_pointing_to_the_torch_one():
    with pytest.raises(ValueError) as info:
        to_trainer_args({"strategy": "fsdp"})
    message = str(info.value)
    assert "strategy='fsdp'" in message and "RingEstimator(strategy='fsdp')" in message
