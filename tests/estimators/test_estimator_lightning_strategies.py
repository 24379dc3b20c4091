"""A LightningModule under Lightning's own strategies: ``trainer_args={"strategy": "ddp"}``
runs Lightning's ``DDPStrategy`` on the job's process group (learns the digits, resumes
its ``run_id``, its saved model reloads with the same weights), and what ringtrain does
not run is refused before any Spark job: ``"fsdp"`` (Lightning's FSDPStrategy is CUDA-only, which
is pinned here too), ``"ddp_spawn"``, an unknown name, a strategy object of another
kind, and a host layout Lightning cannot number.

On the suite's shared ``local[2]`` session. Classes are made inside functions so that
cloudpickle ships them by value.
"""

from __future__ import annotations

import glob
import io
import json
import sys
from types import SimpleNamespace

import _spark
import cloudpickle
import numpy as np
import pytest
import torch
from _digits import demo

from estimators import RingEstimator, RingModel, Store

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)
SEED = demo.SEED  # what the workers' modules use: they cannot import the demo script


@pytest.fixture(scope="module", autouse=True)
def _by_value():
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    yield
    cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def spark():
    session = _spark.shared_session()  # never stopped here: see tests/_spark.py
    session.sparkContext.setLogLevel("FATAL")
    return session


@pytest.fixture(scope="module")
def digits(spark):
    return demo.digits_frame(spark).randomSplit([0.8, 0.2], seed=demo.SEED)


def _ddp_module(out: str):
    """A digits classifier that records, on every step, what Lightning's DDP gives it."""
    import lightning.pytorch as pl

    class DdpDigits(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SEED)
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
            import torch.distributed as dist

            trainer = self.trainer
            record = {
                "strategy": type(trainer.strategy).__name__,
                "wrapped": type(trainer.model).__name__,
                "world": [trainer.world_size, trainer.num_devices, trainer.num_nodes],
                "ranks": [trainer.global_rank, dist.get_rank()],
                "global_step": self.global_step,
            }
            with open(f"{out}/steps-rank{trainer.global_rank}.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
            loss, acc = self._step(batch)
            self.log("acc", acc)
            return loss

        def validation_step(self, batch, batch_idx):
            loss, acc = self._step(batch)
            self.log("val_acc", acc, sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-2)

    return DdpDigits()


def _estimator(model, store: Store, epochs: int, trainer_args: dict) -> RingEstimator:
    return RingEstimator(
        model=model,
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=epochs,
        num_proc=2,
        validation=0.1,
        store=store,
        random_seed=SEED,
        run_id="ddp",
        inmemory_cache_all=True,
        trainer_args=trainer_args,
        verbose=0,
    )


def _predictions(model: RingModel, df) -> tuple[np.ndarray, np.ndarray]:
    """``(labels, logits)`` of the rows of ``df``, as the executors computed them."""
    rows = model.transform(df).select("label", "label__output").collect()
    return np.array([r["label"] for r in rows]), np.array([r["label__output"] for r in rows])


def _steps(out) -> dict[int, list[dict]]:
    found = {}
    for path in sorted(glob.glob(f"{out}/steps-rank*.jsonl")):
        with open(path) as f:
            found[int(path.rsplit("rank", 1)[1].split(".")[0])] = [json.loads(x) for x in f]
    return found


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_ddp_runs_lightnings_ddp_learns_the_digits_resumes_and_saves_the_same_weights(
    digits, tmp_path
):
    train, test = digits
    store = Store.create(str(tmp_path / "store"))
    fitted = _estimator(_ddp_module(str(tmp_path)), store, 2, {"strategy": "ddp"}).fit(train)

    steps = _steps(tmp_path)
    assert sorted(steps) == [0, 1]
    for rank, records in steps.items():
        assert {r["strategy"] for r in records} == {"DDPStrategy"}
        assert {r["wrapped"] for r in records} == {"DistributedDataParallel"}
        assert {tuple(r["world"]) for r in records} == {(2, 2, 1)}  # devices=2, num_nodes=1
        assert {tuple(r["ranks"]) for r in records} == {(rank, rank)}
    per_epoch = len(steps[0]) // 2
    history = fitted.getHistory()
    assert [e["epoch"] for e in history] == [1, 2]
    assert {"train_loss", "train_acc", "val_loss", "val_acc"} <= set(history[-1])
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    labels, logits = _predictions(fitted, test)
    assert (logits.argmax(axis=1) == labels).mean() > 0.85  # the RingStrategy fit's bar

    fitted.save(str(tmp_path / "saved"))  # the reloaded module: the same weights
    reloaded = RingModel.load(str(tmp_path / "saved")).getModel().state_dict()
    for name, value in fitted.getModel().state_dict().items():
        torch.testing.assert_close(reloaded[name], value, rtol=0, atol=0)

    # the same run_id for 3 epochs: Lightning's DDP goes on at epoch 3 from the store
    resumed = _estimator(_ddp_module(str(tmp_path)), store, 3, {"strategy": "ddp"}).fit(train)
    assert [e["epoch"] for e in resumed.getHistory()] == [1, 2, 3]
    assert resumed.getHistory()[:2] == history
    assert [r["global_step"] for r in _steps(tmp_path)[0][2 * per_epoch :]] == list(
        range(2 * per_epoch, 3 * per_epoch)
    )
    checkpoint = torch.load(store.get_checkpoint_path("ddp"), weights_only=True)
    trainer_state = torch.load(io.BytesIO(checkpoint["lightning"]), weights_only=True)
    assert checkpoint["epoch"] == 3 and trainer_state["global_step"] == 3 * per_epoch


def _module():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return self(batch["features"]).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Tiny()


def test_fsdp_and_unknown_strategy_names_are_refused_as_they_are_set(tmp_path):
    for name, expected in (
        ("fsdp", "RingEstimator(strategy='fsdp')"),
        ("fsdp_cpu_offload", "runs on CUDA only"),
        ("deepspeed", "the accepted ones are 'ddp'"),
        ("ddp_spawn", "has none to start"),
    ):
        with pytest.raises(ValueError) as info:
            _estimator(_module(), Store.create(str(tmp_path)), 1, {"strategy": name})
        assert f"strategy={name!r}" in str(info.value) and expected in str(info.value), name


@pytest.mark.spark
def test_strategy_objects_other_than_a_launcher_started_ddp_are_refused_before_any_job(
    spark, digits, tmp_path
):
    import lightning.pytorch as pl

    store = Store.create(str(tmp_path))
    for strategy, expected in (
        (pl.strategies.FSDPStrategy(), "runs on CUDA only"),
        (pl.strategies.DDPStrategy(start_method="spawn"), "DDPStrategy(...)"),
        (pl.strategies.DDPStrategy(parallel_devices=[torch.device("cpu")]), "parallel_devices"),
    ):
        estimator = _estimator(_module(), store, 1, {"strategy": strategy})
        message = _spark.fit_refused_before_any_job(spark, estimator, digits[0])
        assert "trainer_args sets" in message and expected in message, message


def test_lightnings_fsdp_strategy_refuses_the_cpu_which_is_why_fsdp_is_not_offered():
    import lightning.pytorch as pl

    with pytest.raises(ValueError, match="requires a GPU accelerator"):
        pl.Trainer(strategy="fsdp", accelerator="cpu", devices=2, logger=False)


def test_hosts_with_different_rank_counts_are_refused_on_every_rank(monkeypatch):
    from estimators.frameworks.lightning import _strategies

    layout = [(0, 0, 2, 0, True), (1, 1, 2, 0, True), (2, 0, 1, 1, True)]
    fake = SimpleNamespace(
        rank=lambda: 0, local_rank=lambda: 0, local_size=lambda: 2,
        allgather_object=lambda obj, name=None: layout,
    )  # fmt: skip
    monkeypatch.setattr(_strategies, "hvd", fake)
    with pytest.raises(ValueError, match=r"hosts run \[1, 2\] ranks"):
        _strategies.check_layout()
    layout[:] = [(0, 0, 1, 1, True), (1, 0, 1, 0, True)]  # rank 0 on the second host
    with pytest.raises(ValueError, match=r"rank 0 .* is not where Lightning"):
        _strategies.check_layout()
