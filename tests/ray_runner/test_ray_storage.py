"""RingTrainer's storage and checkpoints like Ray Train's, on a real S3 API (moto on 127.0.0.1)
and a real local Ray instance (2 CPUs, 2 workers).

storage_path="s3://..." with a pyarrow S3 filesystem, sharded checkpoints (every rank's
files in one folder), retention by score, Result.best_checkpoints, driver callbacks, a
resume from the bucket, refusals before any worker starts, and a Ray Train-style script
ported by changing its imports only.
"""

from __future__ import annotations

import os
import tempfile

import pytest
from _servers import local_ray, moto_s3_server

ray = pytest.importorskip("ray")
pytest.importorskip("moto")

import ray_runner  # noqa: E402
from ray_runner import (  # noqa: E402
    Callback,
    Checkpoint,
    CheckpointConfig,
    RayExecutor,
    RingTrainer,
    RunConfig,
    ScalingConfig,
)
from ray_runner._storage import StorageError  # noqa: E402

BUCKET = "ringruns"
SHARED_RAY = True  # on the suite's shared local Ray instance (tests/_servers.py local_ray)
SCORES = [0.5, 0.9, 0.1, 0.3]  # iteration -> score; max keeps 1 and 0, the latest 3 stays


@pytest.fixture(scope="module")
def s3():
    """The loopback S3 server with one bucket, and a pyarrow filesystem for it."""
    import boto3
    import pyarrow.fs as pafs

    with moto_s3_server() as options:
        client = boto3.client(
            "s3",
            endpoint_url=options["endpoint_url"],
            aws_access_key_id=options["key"],
            aws_secret_access_key=options["secret"],
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        fs = pafs.S3FileSystem(
            endpoint_override=str(options["endpoint_url"]).removeprefix("http://"),
            scheme="http",
            access_key=options["key"],
            secret_key=options["secret"],
            region="us-east-1",
        )
        yield client, fs


@pytest.fixture(scope="module")
def ray_cluster():
    with local_ray(__name__):  # the worker functions here travel by value
        yield


class _Recorder(Callback):
    def __init__(self):
        self.events: list[tuple] = []

    def on_start(self, *, name, path, config):
        self.events.append(("start", name, path))

    def on_report(self, metrics, checkpoint):
        self.events.append(("report", metrics["it"], checkpoint is not None))

    def on_end(self, result):
        self.events.append(("end", result.metrics["it"]))


def _sharded_loop(config):
    import time

    rank = ray_runner.get_context().get_world_rank()
    restored = ray_runner.get_checkpoint()
    start = 0
    if restored is not None:
        with restored.as_directory() as path:
            with open(os.path.join(path, "it")) as fh:
                start = int(fh.read()) + 1
            shards = sorted(f for f in os.listdir(path) if f.startswith("shard-"))
        assert shards == ["shard-rank0.txt", "shard-rank1.txt"], shards
    for it in range(start, config["iterations"]):
        if rank == 1:  # a slow rank: rank 0 reports each iteration well before it
            time.sleep(config.get("rank1_delay_s", 0.0))
        with tempfile.TemporaryDirectory() as tmp:
            with open(os.path.join(tmp, f"shard-rank{rank}.txt"), "w") as fh:
                fh.write(f"rank {rank} it {it}")
            with open(os.path.join(tmp, "it"), "w") as fh:  # every rank: rank 0's is kept
                fh.write(str(it) if rank == 0 else "written by rank 1")
            ray_runner.report(
                {"it": it, "score": SCORES[it % len(SCORES)], "start": start},
                checkpoint=Checkpoint.from_directory(tmp),
            )


def _keys(client, prefix: str) -> list[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
    return sorted(o["Key"][len(prefix) :] for page in pages for o in page.get("Contents", []))


@pytest.mark.ray
@pytest.mark.timeout(180)
def test_s3_run_keeps_sharded_checkpoints_by_score_calls_callbacks_and_resumes(s3, ray_cluster):
    client, fs = s3
    recorder = _Recorder()
    run_config = RunConfig(
        name="sharded",
        storage_path=f"s3://{BUCKET}/runs",
        storage_filesystem=fs,
        checkpoint_config=CheckpointConfig(num_to_keep=2, checkpoint_score_attribute="score"),
        callbacks=[recorder],
        verbose=0,
    )
    result = RingTrainer(
        _sharded_loop,
        train_loop_config={"iterations": 4},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=run_config,
    ).fit()

    # the two best by score (iterations 1 and 0) and the latest (3) stay in the bucket
    keys = _keys(client, "runs/sharded/")
    folders = sorted({k.split("/")[0] for k in keys if k.startswith("checkpoint_")})
    assert folders == ["checkpoint_000000", "checkpoint_000001", "checkpoint_000003"]
    for folder in folders:  # both ranks' shards merged into each one
        assert {f"{folder}/shard-rank0.txt", f"{folder}/shard-rank1.txt", f"{folder}/it"} <= set(
            keys
        )
    staged = [k for k in keys if "/shards/" in k and not k.endswith("/")]
    assert staged == []  # every staged file was moved in
    body = client.get_object(Bucket=BUCKET, Key="runs/sharded/checkpoint_000003/it")["Body"]
    assert body.read() == b"3"  # the name both ranks wrote holds rank 0's file

    assert [m["score"] for _, m in result.best_checkpoints] == [0.9, 0.5, 0.3]
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000003")
    assert result.path == f"{BUCKET}/runs/sharded" and result.filesystem is fs
    with (
        result.checkpoint.as_directory() as path,
        open(os.path.join(path, "shard-rank1.txt")) as fh,
    ):
        assert fh.read() == "rank 1 it 3"

    assert recorder.events == [
        ("start", "sharded", f"{BUCKET}/runs/sharded"),
        *[("report", it, True) for it in range(4)],
        ("end", 3),
    ]

    # the same name resumes from the bucket's latest checkpoint (3) and goes on
    resumed = RingTrainer(
        _sharded_loop,
        train_loop_config={"iterations": 5},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="sharded",
            storage_path=f"s3://{BUCKET}/runs",
            storage_filesystem=fs,
            verbose=0,
        ),
    ).fit()
    assert resumed.metrics == {"it": 4, "score": SCORES[0], "start": 4}
    assert resumed.checkpoint is not None and resumed.checkpoint.path.endswith("checkpoint_000004")


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_slow_ranks_shard_is_in_every_checkpoint_even_the_first(ray_cluster, tmp_path):
    """Rank 0 reports each checkpoint 1.5 s before rank 1 does, the first one included
    (when the driver has seen no report of rank 1 yet): every committed checkpoint still
    holds rank 1's shard, and no staged file is left behind."""
    recorder = _Recorder()
    result = RingTrainer(
        _sharded_loop,
        train_loop_config={"iterations": 2, "rank1_delay_s": 1.5},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(
            name="slow", storage_path=str(tmp_path), callbacks=[recorder], verbose=0
        ),
    ).fit()
    folders = sorted(f for f in os.listdir(tmp_path / "slow") if f.startswith("checkpoint_"))
    assert folders == ["checkpoint_000000", "checkpoint_000001"]
    for it, folder in enumerate(folders):
        with open(tmp_path / "slow" / folder / "shard-rank1.txt") as fh:
            assert fh.read() == f"rank 1 it {it}"
    staged = [p for p in (tmp_path / "slow").rglob("*") if "shards" in p.parts and p.is_file()]
    assert staged == []
    assert [e for e in recorder.events if e[0] == "report"] == [
        ("report", 0, True),
        ("report", 1, True),
    ]
    assert result.checkpoint is not None and result.checkpoint.path.endswith("checkpoint_000001")


class _NeverStarts(RayExecutor):
    def start(self, *args, **kwargs):
        raise AssertionError("a worker group was started despite a bad storage_path")


@pytest.mark.ray
def test_a_storage_path_that_cannot_be_opened_fails_before_any_worker_starts(s3, ray_cluster):
    _, fs = s3

    def fit(**run):
        trainer = RingTrainer(lambda: None, run_config=RunConfig(verbose=0, **run))
        trainer.executor_cls = _NeverStarts
        trainer.fit()

    with pytest.raises(StorageError, match=r"storage_path='nosuch://x/y'.*install the fsspec"):
        fit(storage_path="nosuch://x/y")
    with pytest.raises(StorageError, match=r"memory:// filesystem lives inside one process"):
        fit(storage_path="memory://runs")
    with pytest.raises(StorageError, match=r"the bucket 'no-such-bucket' does not exist"):
        fit(storage_path="s3://no-such-bucket/runs", storage_filesystem=fs)


def test_score_attribute_missing_from_a_checkpoints_metrics_is_named(tmp_path):
    from ray_runner._checkpoint import CheckpointStore

    store = CheckpointStore(str(tmp_path), score_attribute="val_loss")
    with pytest.raises(ValueError, match=r"checkpoint_score_attribute='val_loss'.*\['loss'\]"):
        store.score({"loss": 1.0})
    with pytest.raises(ValueError, match=r"checkpoint_score_order must be 'max' or 'min'"):
        CheckpointConfig(checkpoint_score_order="best")
    with pytest.raises(ValueError, match=r"each callback must be a ray_runner\.Callback"):
        RunConfig(callbacks=[print])


# A Ray Train script, verbatim but for its imports (swapped by _port below).
RAY_TRAIN_SCRIPT = """
import os
import tempfile

import torch
from torch.utils.data import DataLoader, TensorDataset

import ray.train
from ray.train import Checkpoint
from ray.train.torch import get_device, prepare_data_loader, prepare_model


def train_func(config):
    torch.manual_seed(ray.train.get_context().get_world_rank())  # ranks start apart
    model = prepare_model(torch.nn.Linear(2, 1))
    x = torch.arange(32, dtype=torch.float32).reshape(16, 2) / 16
    y = x @ torch.tensor([[2.0], [-1.0]])
    loader = prepare_data_loader(DataLoader(TensorDataset(x, y), batch_size=4, shuffle=True))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
    for epoch in range(config["epochs"]):
        loader.sampler.set_epoch(epoch)
        seen, total = 0, 0.0
        for xb, yb in loader:
            xb, yb = xb.to(get_device()), yb.to(get_device())
            loss = torch.nn.functional.mse_loss(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            seen, total = seen + len(xb), total + loss.item()
        rank = ray.train.get_context().get_world_rank()
        with tempfile.TemporaryDirectory() as tmp:
            torch.save(model.state_dict(), os.path.join(tmp, f"model-rank{rank}.pt"))
            ray.train.report({"epoch": epoch, "loss": total, "seen": seen},
                             checkpoint=Checkpoint.from_directory(tmp))
"""

RAY_IMPORTS = """import ray.train
from ray.train import Checkpoint
from ray.train.torch import get_device, prepare_data_loader, prepare_model
"""
OUR_IMPORTS = """import ray_runner as ray_train_module
from ray_runner import Checkpoint
from ray_runner import get_device, prepare_data_loader, prepare_model
"""


def _port(script: str) -> dict:
    """Change the imports only: ``ray.train`` becomes ``ray_runner``."""
    assert RAY_IMPORTS in script
    source = script.replace(RAY_IMPORTS, OUR_IMPORTS).replace("ray.train.", "ray_train_module.")
    namespace: dict = {"__name__": "ported_ray_train_script"}
    exec(compile(source, "<ported script>", "exec"), namespace)
    return namespace


@pytest.mark.ray
@pytest.mark.timeout(120)
def test_a_ray_train_script_ports_by_changing_its_imports(ray_cluster, tmp_path):
    import torch

    script = _port(RAY_TRAIN_SCRIPT)
    result = RingTrainer(
        script["train_func"],
        train_loop_config={"lr": 0.1, "epochs": 3},
        scaling_config=ScalingConfig(num_workers=2),
        run_config=RunConfig(name="ported", storage_path=str(tmp_path), verbose=0),
    ).fit()
    losses = list(result.metrics_dataframe["loss"])
    assert losses[-1] < losses[0]
    assert result.metrics["seen"] == 8  # the DistributedSampler gave each rank half of 16
    with result.checkpoint.as_directory() as path:
        weights = [torch.load(os.path.join(path, f"model-rank{r}.pt")) for r in (0, 1)]
    # rank 0's start broadcast and gradients averaged: both ranks hold the same model
    for name in weights[0]:
        assert torch.equal(weights[0][name], weights[1][name]), name
