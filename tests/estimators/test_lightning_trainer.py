"""A LightningModule under a real ``lightning.Trainer``: RingStrategy on the ring, and
RingEstimator fits on real Spark (``local[2]``, two ranks over Gloo).

- ``RingStrategy`` alone (``ringcore.testing.run_workers``, no Spark): two ranks with
  half a batch each end with the weights of one process stepping on the whole batch
  (gradients averaged after backward, clipped after averaging), and Lightning's
  collectives (``self.log(sync_dist=True)``, ``all_gather``, ``broadcast``, ``reduce``,
  ``reduce_boolean_decision``, ``barrier``) go over the ring; for ``lightning.pytorch``
  and ``pytorch_lightning`` both.
- One fit on the digits reads ``self.trainer``, ``self.current_epoch`` and
  ``self.global_step``; a user Callback sees every epoch on every rank; a CSVLogger and
  a profiler get the fit; ``trainer_args`` bf16 autocast and gradient clipping take
  effect; both ranks end with the weights of the store's checkpoint.
- Manual optimization with two optimizers, then a resumed ``run_id`` that goes on at
  the next epoch with the Trainer's counters and both optimizers' states.
- ``terminate_on_nan`` stops every rank at the first non-finite loss, with one error.
- The Lightning-only params are refused before any Spark job where they do not apply.

Classes are made inside functions so that cloudpickle ships them by value.
"""

from __future__ import annotations

import csv
import glob
import io
import json
import os
import sys

import _spark
import cloudpickle
import numpy as np
import pytest
import torch
from _digits import demo

from estimators import Callback, RingEstimator, Store, read_tensorboard_scalars
from estimators._params import ESTIMATOR_PARAMS
from estimators.fit._resolve import param_values, refuse_foreign_params
from estimators.frameworks import get_framework
from estimators.frameworks.lightning._trainer_args import LIGHTNING_PARAMS
from ringcore import WorkerError
from ringcore.testing import run_workers

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)
SEED = demo.SEED  # what the workers' modules use: they cannot import the demo script

# --- RingStrategy on two ranks, against one process on the whole batch ---------------------

_ROWS, _STEPS, _CLIP = 8, 3, 0.5


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(_STEPS, 2 * _ROWS, 5, generator=gen)
    return x, x.sum(dim=2, keepdim=True) + 0.1 * torch.randn(_STEPS, 2 * _ROWS, 1, generator=gen)


def _regression(package: str):
    import importlib

    pl = importlib.import_module(package)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(1)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(5, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1)
            )

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.mse_loss(self.net(batch["x"]), batch["y"])
            self.log("rank", float(self.global_rank), sync_dist=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.2)

    return Regression()


class _Batches:
    """An iterable of batches (a list would be taken for a list of dataloaders)."""

    def __init__(self, batches: list) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self):
        return iter(self.batches)


def _two_ranks(packages: list[str]) -> dict:
    import importlib

    import ringcore.torch as hvd
    from estimators.frameworks.lightning._strategy import lightning_package, ring_strategy

    hvd.init()
    rank, (x, y) = hvd.rank(), _data()
    out = {}
    for package in packages:
        pl = importlib.import_module(package)
        module = _regression(package)
        assert lightning_package(module) is pl
        part = slice(rank * _ROWS, (rank + 1) * _ROWS)
        batches = _Batches([{"x": x[s, part], "y": y[s, part]} for s in range(_STEPS)])
        trainer = pl.Trainer(
            strategy=ring_strategy(pl, torch.device("cpu")),
            accelerator="cpu",
            devices=1,
            max_epochs=1,
            gradient_clip_val=_CLIP,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, train_dataloaders=batches)
        strategy = trainer.strategy
        gathered = strategy.all_gather(torch.tensor([rank, 10 + rank]))
        out[package] = {
            "weights": {k: v.tolist() for k, v in module.state_dict().items()},
            "rank_logged": float(trainer.callback_metrics["rank"]),
            "gathered": gathered.tolist(),
            "broadcast": strategy.broadcast(f"from {rank}", src=1),
            "sum": float(strategy.reduce(torch.tensor(rank + 1.0), reduce_op="sum")),
            "max": float(strategy.reduce(torch.tensor(rank + 1.0), reduce_op="max")),
            "mean": float(strategy.reduce(torch.tensor(rank + 1))),
            "all": strategy.reduce_boolean_decision(rank == 0),
            "any": strategy.reduce_boolean_decision(rank == 0, all=False),
            "global_step": trainer.global_step,
            "is_global_zero": trainer.is_global_zero,
            "world_size": trainer.world_size,
        }
        strategy.barrier()
    out["accumulated"] = _accumulated(rank, x, y)
    return out


def _accumulated(rank: int, x: torch.Tensor, y: torch.Tensor) -> dict:
    """accumulate_grad_batches=2: the ring averages once per optimizer step."""
    import lightning.pytorch as pl

    from estimators.frameworks.lightning import _strategy as _lightning_strategy

    calls = []
    average = _lightning_strategy.average_gradients
    _lightning_strategy.average_gradients = lambda m: calls.append(1) or average(m)
    module = _regression("lightning.pytorch")
    part = slice(rank * _ROWS, (rank + 1) * _ROWS)
    trainer = pl.Trainer(
        strategy=_lightning_strategy.ring_strategy(pl, torch.device("cpu")),
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, _Batches([{"x": x[s, part], "y": y[s, part]} for s in range(_STEPS)]))
    return {
        "weights": {k: v.tolist() for k, v in module.state_dict().items()},
        "averaged": len(calls),
        "global_step": trainer.global_step,
    }


def _one_process_reference(accumulate: int = 1, clip: float | None = _CLIP) -> dict[str, list]:
    """Plain torch on the whole batch: the same init, loss, SGD step, norm clipping and
    accumulation (each loss divided by it, the last partial group steps too)."""
    module = _regression("lightning.pytorch")
    optimizer = torch.optim.SGD(module.parameters(), lr=0.2)
    x, y = _data()
    optimizer.zero_grad()
    for s in range(_STEPS):
        loss = torch.nn.functional.mse_loss(module.net(x[s]), y[s])
        (loss / accumulate).backward()
        if (s + 1) % accumulate == 0 or s + 1 == _STEPS:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(module.parameters(), clip)
            optimizer.step()
            optimizer.zero_grad()
    return {k: v.tolist() for k, v in module.state_dict().items()}


@pytest.mark.timeout(240)
def test_two_ranks_train_as_one_process_on_the_whole_batch_and_collectives_use_the_ring():
    packages = ["lightning.pytorch", "pytorch_lightning"]
    results = run_workers(_two_ranks, args=(packages,), np=2)
    reference = _one_process_reference()
    for package in packages:
        by_rank = [r[package] for r in results]
        assert by_rank[0]["weights"] == by_rank[1]["weights"], package  # bit-identical
        for name, value in reference.items():
            np.testing.assert_allclose(by_rank[0]["weights"][name], value, rtol=1e-5, atol=1e-6)
        for rank, got in enumerate(by_rank):
            assert got["rank_logged"] == 0.5  # self.log(sync_dist=True): the ranks' mean
            assert got["gathered"] == [[0, 10], [1, 11]]
            assert got["broadcast"] == "from 1"
            assert (got["sum"], got["max"], got["mean"]) == (3.0, 2.0, 1.5)
            assert (got["all"], got["any"]) == (False, True)
            assert got["global_step"] == _STEPS and got["world_size"] == 2
            assert got["is_global_zero"] is (rank == 0)
    # accumulate_grad_batches=2 over 3 batches: 2 steps, one allreduce each
    accumulated = [r["accumulated"] for r in results]
    assert accumulated[0]["weights"] == accumulated[1]["weights"]
    assert [(a["averaged"], a["global_step"]) for a in accumulated] == [(2, 2), (2, 2)]
    for name, value in _one_process_reference(accumulate=2, clip=None).items():
        np.testing.assert_allclose(accumulated[0]["weights"][name], value, rtol=1e-5, atol=1e-6)


# --- RingEstimator fits on Spark -----------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _by_value():
    """The modules, callbacks and helpers below travel to the Spark workers by value."""
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
    """600 digits rows: about 8 steps per epoch per rank at batch_size 32."""
    return demo.digits_frame(spark).limit(600).cache()


def _write(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _read(pattern: str) -> dict[int, list[dict]]:
    """``{rank: records}`` of the files ``pattern`` (with ``{rank}``) names."""
    out = {}
    for path in sorted(glob.glob(pattern.format(rank="*"))):
        rank = int(path.rsplit("rank", 1)[1].split(".")[0])
        with open(path) as f:
            out[rank] = [json.loads(line) for line in f]
    return out


def _digits_probe(out: str, clip: float):
    """A module that checks, on every step, what a real Trainer gives it."""
    import lightning.pytorch as pl

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(SEED)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10)
            )

        def forward(self, x):
            return self.net(x)

        def _step(self, batch):
            logits = self(batch["features"])
            label = batch["label"].long()
            loss = torch.nn.functional.cross_entropy(logits.float(), label)
            return logits, loss, (logits.argmax(dim=1) == label).float().mean()

        def training_step(self, batch, batch_idx):
            trainer = self.trainer
            assert trainer.strategy.strategy_name == "ringtrain"
            assert (trainer.world_size, trainer.max_epochs) == (2, 2)
            assert trainer.global_rank == self.global_rank == int(os.environ["RING_RANK"])
            # trainer_args={"precision": "bf16-mixed"}: the step runs under bf16 autocast
            assert torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
            logits, loss, acc = self._step(batch)
            assert logits.dtype == torch.bfloat16
            self.log("acc", acc)
            _write(
                f"{out}/steps-rank{self.global_rank}.jsonl",
                {"epoch": self.current_epoch, "global_step": self.global_step, "batch": batch_idx},
            )
            return loss

        def validation_step(self, batch, batch_idx):
            _, loss, acc = self._step(batch)
            self.log("val_acc", acc, sync_dist=True)
            return loss

        def configure_gradient_clipping(
            self, optimizer, gradient_clip_val, gradient_clip_algorithm
        ):
            assert gradient_clip_val == clip  # trainer_args={"gradient_clip_val": clip}
            before = _grad_norm(self)
            self.clip_gradients(optimizer, gradient_clip_val, gradient_clip_algorithm)
            _write(
                f"{out}/norms-rank{self.global_rank}.jsonl",
                {"before": before, "after": _grad_norm(self)},
            )

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

    return Probe()


def _grad_norm(module) -> float:
    return float(torch.norm(torch.stack([p.grad.norm() for p in module.parameters()])))


def _seen_callback(out: str):
    import lightning.pytorch as pl

    class Seen(pl.Callback):
        def on_train_epoch_end(self, trainer, pl_module):
            _write(
                f"{out}/epochs-rank{trainer.global_rank}.jsonl",
                {"epoch": trainer.current_epoch, "global_step": trainer.global_step},
            )

        def on_train_end(self, trainer, pl_module):
            torch.save(pl_module.state_dict(), f"{out}/weights-rank{trainer.global_rank}.pt")

    return Seen()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_a_lightning_fit_gets_a_real_trainer_its_callbacks_logger_precision_and_clipping(
    digits, tmp_path
):
    from lightning.pytorch.loggers import CSVLogger
    from lightning.pytorch.profilers import SimpleProfiler

    out, clip = str(tmp_path), 0.05
    store = Store.create(str(tmp_path / "store"))
    fitted = RingEstimator(
        model=_digits_probe(out, clip),
        feature_cols=["features"],
        label_cols=["label"],
        validation=0.2,
        batch_size=32,
        epochs=2,
        num_proc=2,
        random_seed=demo.SEED,
        store=store,
        run_id="probe",
        callbacks=[_seen_callback(out)],
        logger=CSVLogger(str(tmp_path / "logs"), name="csv"),
        log_every_n_steps=2,
        profiler=SimpleProfiler(dirpath=str(tmp_path / "profile"), filename="perf"),
        trainer_args={"precision": "bf16-mixed", "gradient_clip_val": clip},
        verbose=0,
    ).fit(digits)

    steps = _read(out + "/steps-rank{rank}.jsonl")
    assert sorted(steps) == [0, 1]
    per_epoch = len(steps[0]) // 2
    assert per_epoch >= 4 and len(steps[1]) == 2 * per_epoch
    for records in steps.values():  # current_epoch and global_step as Lightning counts them
        assert [(r["epoch"], r["batch"]) for r in records] == [
            (e, b) for e in range(2) for b in range(per_epoch)
        ]
        assert [r["global_step"] for r in records] == list(range(2 * per_epoch))

    epochs = _read(out + "/epochs-rank{rank}.jsonl")  # the user callback, every epoch, every rank
    assert epochs == {
        r: [{"epoch": e, "global_step": (e + 1) * per_epoch} for e in (0, 1)] for r in (0, 1)
    }

    norms = _read(out + "/norms-rank{rank}.jsonl")  # clipped after the ring averaged them
    assert norms[0] == norms[1] and len(norms[0]) == 2 * per_epoch
    assert all(n["after"] <= clip * 1.001 for n in norms[0])
    assert all(n["before"] > clip for n in norms[0])

    history = fitted.getHistory()
    assert [e["epoch"] for e in history] == [1, 2]
    assert {"train_loss", "train_acc", "val_loss", "val_acc", "seconds"} <= set(history[-1])

    # rank 0's live progress file and TensorBoard scalars, as the torch loop's
    progress = store.read_json(store.get_logs_path("probe") + "/progress.json")
    assert (progress["epoch"], progress["epochs"]) == (2, 2)
    assert progress["step"] == progress["steps"] == per_epoch and progress["rows_per_s"] > 0
    scalars = read_tensorboard_scalars(store, "probe")
    assert [step for step, _ in scalars["step/loss"]] == list(range(1, 2 * per_epoch + 1))
    for name in ("train_loss", "val_loss", "val_acc"):
        assert [s for s, _ in scalars[f"epoch/{name}"]] == [1, 2], name
        assert scalars[f"epoch/{name}"][-1][1] == pytest.approx(history[-1][name], rel=1e-5)

    # both ranks end with the same weights, the ones in the store's checkpoint and model
    ranks = [torch.load(f"{out}/weights-rank{r}.pt", weights_only=True) for r in (0, 1)]
    final = fitted.getModel().state_dict()
    for name, value in final.items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.equal(ranks[0][name], value), name

    # the logger wrote on rank 0 only, one row per 2 training steps plus the epoch rows
    (metrics,) = glob.glob(str(tmp_path / "logs" / "csv" / "version_*" / "metrics.csv"))
    with open(metrics) as f:
        rows = list(csv.DictReader(f))
    train_rows = [r for r in rows if r.get("acc")]
    assert len(train_rows) == per_epoch and all(int(r["step"]) % 2 == 1 for r in train_rows)
    assert [r["epoch"] for r in rows if r.get("val_acc")] == ["0", "1"]
    # the profiler profiled the fit on both ranks (its report per local rank)
    assert sorted(os.listdir(tmp_path / "profile")) == ["fit-perf-0.txt", "fit-perf-1.txt"]


def _two_optimizers(out: str):
    """Manual optimization: an encoder and a head, each with its own optimizer and loss."""
    import lightning.pytorch as pl

    class TwoOptimizers(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.automatic_optimization = False
            torch.manual_seed(SEED)
            self.encoder = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU())
            self.head = torch.nn.Linear(16, 10)

        def forward(self, x):
            return self.head(self.encoder(x))

        def training_step(self, batch, batch_idx):
            encoder_opt, head_opt = self.optimizers()
            label = batch["label"].long()
            _write(
                f"{out}/manual-rank{self.global_rank}.jsonl",
                {"epoch": self.current_epoch, "global_step": self.global_step},
            )
            # the head steps on the encoder's features, held fixed
            head_loss = torch.nn.functional.cross_entropy(
                self.head(self.encoder(batch["features"]).detach()), label
            )
            head_opt.zero_grad()
            self.manual_backward(head_loss)
            head_opt.step()
            # then the encoder, through the updated head
            loss = torch.nn.functional.cross_entropy(self(batch["features"]), label)
            encoder_opt.zero_grad()
            self.manual_backward(loss)
            encoder_opt.step()
            self.log("head_loss", head_loss)
            return loss

        def configure_optimizers(self):
            return (
                torch.optim.Adam(self.encoder.parameters(), lr=1e-2),
                torch.optim.SGD(self.head.parameters(), lr=0.1, momentum=0.9),
            )

    return TwoOptimizers()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_manual_optimization_with_two_optimizers_resumes_at_the_next_epoch(digits, tmp_path):
    out = str(tmp_path)
    store = Store.create(str(tmp_path / "store"))

    def fit(epochs):
        return RingEstimator(
            model=_two_optimizers(out),
            feature_cols=["features"],
            label_cols=["label"],
            batch_size=32,
            epochs=epochs,
            num_proc=2,
            random_seed=demo.SEED,
            store=store,
            run_id="manual",
            callbacks=[_seen_callback(out)],
            inmemory_cache_all=True,
            verbose=0,
        ).fit(digits)

    first = fit(1).getHistory()
    steps = _read(out + "/manual-rank{rank}.jsonl")
    per_epoch = len(steps[0])
    assert per_epoch >= 4 and len(steps[1]) == per_epoch
    # global_step counts optimizer steps: two per batch here, as Lightning counts them
    assert [s["global_step"] for s in steps[0]] == [2 * b for b in range(per_epoch)]

    for path in glob.glob(out + "/manual-rank*.jsonl"):
        os.remove(path)
    resumed = fit(2).getHistory()
    steps = _read(out + "/manual-rank{rank}.jsonl")
    for records in steps.values():  # only epoch 1 ran, with the counters where they were
        assert [(s["epoch"], s["global_step"]) for s in records] == [
            (1, 2 * (per_epoch + b)) for b in range(per_epoch)
        ]
    assert resumed[0] == first[0] and [e["epoch"] for e in resumed] == [1, 2]
    assert {"train_loss", "train_head_loss"} <= set(resumed[1])
    assert resumed[1]["train_loss"] < resumed[0]["train_loss"]

    # both optimizers' states went on: Adam counted every step of both epochs
    checkpoint = torch.load(store.get_checkpoint_path("manual"), weights_only=True)
    state = torch.load(io.BytesIO(checkpoint["lightning"]), weights_only=True)
    adam, sgd = state["optimizer_states"]
    assert int(adam["state"][0]["step"]) == 2 * per_epoch
    assert "momentum_buffer" in sgd["state"][0]
    assert checkpoint["epoch"] == 2 and state["global_step"] == 4 * per_epoch
    ranks = [torch.load(f"{out}/weights-rank{r}.pt", weights_only=True) for r in (0, 1)]
    for name, value in checkpoint["model"].items():
        assert torch.equal(ranks[0][name], ranks[1][name]), name
        assert torch.equal(ranks[0][name], value), name

    # rank 0 claimed the run for its fit; a newer claim (a later attempt) wins: this fit
    # then writes nothing and fails
    assert store.read_json(store.get_writer_path("manual"))["attempt"] == 0
    store.claim_run("manual", (2**62, 0))
    with pytest.raises(WorkerError, match="StaleWriterError"):
        fit(3)
    after = torch.load(store.get_checkpoint_path("manual"), weights_only=True)
    assert after["epoch"] == 2 and after["history"] == checkpoint["history"]


def _nan_on_rank_1():
    import lightning.pytorch as pl

    class NanOnRank1(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            loss = torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"].long())
            if self.current_epoch == 1 and batch_idx == 2 and self.global_rank == 1:
                loss = loss * float("nan")
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return NanOnRank1()


@pytest.mark.spark
@pytest.mark.timeout(300)
def test_terminate_on_nan_stops_every_rank_at_the_first_nan_with_one_error(digits, tmp_path):
    store = Store.create(str(tmp_path / "store"))
    estimator = RingEstimator(
        model=_nan_on_rank_1(),
        feature_cols=["features"],
        label_cols=["label"],
        batch_size=32,
        epochs=3,
        num_proc=2,
        store=store,
        run_id="nan",
        terminate_on_nan=True,
        verbose=0,
    )
    with pytest.raises(WorkerError) as info:
        estimator.fit(digits)
    message = str(info.value)
    assert (
        "terminate_on_nan: the training loss on rank(s) [1] and the parameters on rank(s) [0, 1]"
        in message
    )
    assert "at epoch 1, batch 2" in message
    checkpoint = torch.load(store.get_checkpoint_path("nan"), weights_only=True)
    assert checkpoint["epoch"] == 1  # the last complete epoch stays in the store


# --- refused before any Spark job --------------------------------------------------------


def _lightning_module():
    import lightning.pytorch as pl

    class Small(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(64, 10)

        def forward(self, x):
            return self.net(x)

        def training_step(self, batch, batch_idx):
            return torch.nn.functional.cross_entropy(self(batch["features"]), batch["label"].long())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    return Small()


@pytest.mark.spark
def test_lightning_params_that_cannot_apply_are_refused_before_any_job(spark, digits, tmp_path):
    torch_model = torch.nn.Linear(64, 10)
    torch_params = {
        "model": torch_model,
        "optimizer": torch.optim.SGD(torch_model.parameters(), lr=0.1),
        "loss": torch.nn.CrossEntropyLoss(),
    }
    cases = [
        (
            {**torch_params, "trainer_args": {"precision": "bf16-mixed"}},
            "trainer_args={'precision': 'bf16-mixed'} is set, but the model is a torch model",
        ),
        ({**torch_params, "terminate_on_nan": True}, r"terminate_on_nan=True is set.*torch model"),
        ({**torch_params, "log_every_n_steps": 5}, r"setParams\(log_every_n_steps=50\)"),
        (
            {"model": _lightning_module(), "trainer_args": {"gradient_clip": 1.0}},
            r"trainer_args has 'gradient_clip', which lightning.pytorch.Trainer does not take",
        ),
        (
            {
                "model": _lightning_module(),
                "trainer_args": {"accumulate_grad_batches": 2},
                "backward_passes_per_step": 4,
            },
            r"accumulate_grad_batches=2 and backward_passes_per_step=4",
        ),
        (
            {"model": _lightning_module(), "callbacks": [Callback()]},
            r"is not a lightning.pytorch.Callback",
        ),
    ]
    sc = spark.sparkContext
    group = "test-lightning-params-before-any-job"
    sc.setJobGroup(group, "must stay empty")
    try:
        for params, message in cases:
            store = tmp_path / f"store{len(os.listdir(tmp_path))}"
            estimator = RingEstimator(
                feature_cols=["features"], label_cols=["label"], store=str(store), **params
            )
            with pytest.raises(ValueError, match=message):
                estimator.fit(digits)
        assert sc.statusTracker().getJobIdsForGroup(group) == []
    finally:
        sc.setLocalProperty("spark.jobGroup.id", None)
    # a trainer_args key ringtrain sets itself is refused as it is set
    with pytest.raises(
        ValueError, match=r"sets max_epochs=5, which RingEstimator sets itself: use epochs"
    ):
        RingEstimator(trainer_args={"max_epochs": 5})
    with pytest.raises(ValueError, match=r"sets strategy='ddp_spawn'.*the accepted ones are 'ddp'"):
        RingEstimator().setTrainerArgs({"precision": "bf16-mixed", "strategy": "ddp_spawn"})
    with pytest.raises(TypeError, match="trainer_args takes a dict"):
        RingEstimator(trainer_args="bf16-mixed")


def test_the_lightning_params_and_their_unset_values_are_the_tables():
    defaults = {spec.name: spec.default for spec in ESTIMATOR_PARAMS}
    assert {name: defaults[name] for name in LIGHTNING_PARAMS} == LIGHTNING_PARAMS
    est = RingEstimator(trainer_args={"precision": "bf16-mixed"}, terminate_on_nan=True)
    assert est.getTrainerArgs() == {"precision": "bf16-mixed"} and est.getTerminateOnNan()
    assert est.setLogEveryNSteps(7).getLogEveryNSteps() == 7
    assert not est.isSet("logger") and est.getProfiler() is None
    # Horovod's defaults of these params (None for most) leave them unset for any model
    horovod_defaults = RingEstimator(
        trainer_args=None, logger=None, log_every_n_steps=50, terminate_on_nan=False, profiler=None
    )
    values = param_values(horovod_defaults)
    assert {name: values[name] for name in LIGHTNING_PARAMS} == LIGHTNING_PARAMS
    refuse_foreign_params(values, get_framework("torch"))  # nothing set: nothing refused
