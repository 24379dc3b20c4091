"""Writes the notebooks of this folder from the cells below: ``python notebooks/_build.py``.

This file is the source of the notebooks. Edit a cell here, run the script, and commit
both; ``tests/test_notebooks.py`` fails when a stored notebook differs from what this
script writes (or holds outputs), and executes every notebook headless.

Every notebook runs as is on Databricks and in a local Jupyter: it uses the notebook's
``spark`` when there is one, else builds a local session; its files go under
``/dbfs/tmp/ringtrain/...`` on Databricks (``DATABRICKS_RUNTIME_VERSION`` set), else into
a new temporary directory. ``RING_NOTEBOOK_QUICK=1`` (the tests set it) trains for fewer
epochs so that the five notebooks run in a few minutes on two cores.
"""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

KERNELSPEC = {"display_name": "Python 3", "language": "python", "name": "python3"}


def md(text: str):
    return new_markdown_cell(textwrap.dedent(text).strip())


def code(text: str):
    return new_code_cell(textwrap.dedent(text).strip())


def _setup(slug: str, spark: bool) -> str:
    """The first code cell of every notebook: quick mode, Databricks or not, spark, work dir."""
    lines = [
        "import os",
        "import tempfile",
        "",
        "# RING_NOTEBOOK_QUICK=1 (tests/test_notebooks.py sets it) trains for fewer epochs.",
        'QUICK = os.environ.get("RING_NOTEBOOK_QUICK") == "1"',
        'ON_DATABRICKS = "DATABRICKS_RUNTIME_VERSION" in os.environ',
    ]
    if spark:
        lines += [
            "",
            "# Databricks gives every notebook a `spark`; anywhere else, build a local one.",
            "try:",
            "    spark  # noqa: B018",
            "    OWN_SPARK = False",
            "except NameError:",
            "    import spark_runner",
            "",
            f'    spark = spark_runner.local_session("local[2]", app_name="ringtrain-{slug}")',
            '    spark.sparkContext.setLogLevel("ERROR")',
            "    OWN_SPARK = True",
        ]
    lines += [
        "",
        "# Files every worker must reach: DBFS on Databricks, a temporary directory here.",
        "WORK_DIR = (",
        f'    "/dbfs/tmp/ringtrain/{slug}"',
        "    if ON_DATABRICKS",
        f'    else tempfile.mkdtemp(prefix="ringtrain-{slug}-")',
        ")",
        "os.makedirs(WORK_DIR, exist_ok=True)",
    ]
    if spark:
        lines.append(
            'print(f"Spark {spark.version} on {spark.sparkContext.master}; files under {WORK_DIR}")'
        )
    else:
        lines.append('print(f"files under {WORK_DIR}")')
    return "\n".join(lines)


_STOP_SPARK = """
if OWN_SPARK:  # never stop the session Databricks gave the notebook
    spark.stop()
"""

_DIGITS_FRAME = """
import numpy as np
import pandas as pd
from pyspark.ml.feature import VectorAssembler
from sklearn.datasets import load_digits

images, labels = load_digits(return_X_y=True)  # 1,797 8x8 images bundled with scikit-learn
pixel_cols = [f"pixel_{i}" for i in range(64)]
frame = pd.DataFrame(images / 16.0, columns=pixel_cols)
frame.insert(0, "id", np.arange(len(frame)))
frame["label"] = labels
raw = spark.createDataFrame(frame)  # one column per pixel, as a table would have them

train_raw, test_raw = raw.randomSplit([0.8, 0.2], seed=7)
assembler = VectorAssembler(inputCols=pixel_cols, outputCol="features")
train_df = assembler.transform(train_raw).select("id", "features", "label")
test_df = assembler.transform(test_raw).select("id", "features", "label")
print(f"{len(frame)} images, split 80/20 into train_df and test_df")
"""

_SHOW_DIGITS = """
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 10, figsize=(10, 1.4))
for ax, image, label in zip(axes, images, labels):
    ax.imshow(image.reshape(8, 8), cmap="gray_r")
    ax.set_title(str(label))
    ax.axis("off")
plt.show()
"""

_PLOT_HISTORY = """
history = pd.DataFrame(ring_model.getHistory())
display_cols = [c for c in history.columns if c.endswith(("loss", "accuracy"))]
print(history[["epoch", *display_cols]].round(4).to_string(index=False))

fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
for split in ("train", "val"):
    ax_loss.plot(history["epoch"], history[f"{split}_loss"], marker="o", label=split)
    ax_acc.plot(history["epoch"], history[f"{split}_accuracy"], marker="o", label=split)
ax_loss.set(title="loss", xlabel="epoch")
ax_acc.set(title="accuracy", xlabel="epoch")
ax_loss.legend()
ax_acc.legend()
fig.tight_layout()
fig.savefig(os.path.join(WORK_DIR, "history.png"))
plt.show()
assert len(history) == EPOCHS
"""

_TRANSFORM = """
# transform() runs the model on the executors in Arrow batches and appends
# `label__output`: the 10 logits of each row.
scored = ring_model.transform(test_df).select("id", "label", "label__output")
result = scored.toPandas().sort_values("id").reset_index(drop=True)
logits = np.stack(result["label__output"])
predicted = logits.argmax(axis=1)
accuracy = float((predicted == result["label"]).mean())
print(f"test accuracy: {accuracy:.3f} on {len(result)} rows")
assert accuracy > 0.5, accuracy
"""

_CONFUSION = """
from sklearn.metrics import ConfusionMatrixDisplay, confusion_matrix

matrix = confusion_matrix(result["label"], predicted, labels=list(range(10)))
fig, ax = plt.subplots(figsize=(5, 5))
ConfusionMatrixDisplay(matrix, display_labels=list(range(10))).plot(ax=ax, colorbar=False)
ax.set_title("test set: true vs predicted digit")
fig.savefig(os.path.join(WORK_DIR, "confusion.png"))
plt.show()
"""

_PIPELINE = """
from pyspark.ml import PipelineModel

# The fitted model is a Spark ML Model: it goes into a PipelineModel beside the
# VectorAssembler, and the pipeline saves and loads as any other.
pipeline = PipelineModel(stages=[assembler, ring_model])
# "file:" keeps Spark on the local file system (on Databricks: the /dbfs FUSE mount).
pipeline_path = "file:" + os.path.join(WORK_DIR, "digits_pipeline")
pipeline.write().overwrite().save(pipeline_path)

loaded = PipelineModel.load(pipeline_path)
again = loaded.transform(test_raw).select("id", "label__output").toPandas().sort_values("id")
same = np.allclose(np.stack(again["label__output"]), logits)
print(f"{type(loaded.stages[-1]).__name__} loaded from {pipeline_path}; same outputs: {same}")
assert same
"""


def _install_md(extras: str) -> str:
    return f"""
    **Run it** in a local Jupyter (`pip install "ringtrain[{extras},notebooks]"`) or on
    Databricks (a cluster with ringtrain installed, e.g. `%pip install "ringtrain[{extras}]"`
    in the first cell). On Databricks the notebook uses the cluster's `spark` and writes
    under `/dbfs/tmp/ringtrain/`; elsewhere it starts `local[2]` and writes to a temporary
    directory. `RING_NOTEBOOK_QUICK=1` trains for fewer epochs (the tests set it).
    """


def torch_estimator() -> list:
    return [
        md(
            """
            # Train a PyTorch model on a Spark DataFrame with `RingEstimator`

            scikit-learn's digits (8x8 images, bundled: nothing to download) as a Spark
            DataFrame → `RingEstimator` training a small PyTorch MLP on 2 Spark tasks with a
            ring allreduce → per-epoch metrics and their plot → `transform` on the executors
            → a confusion matrix → the fitted model saved and loaded inside a Spark ML
            `PipelineModel`.
            """
            + _install_md("spark,petastorm")
        ),
        code(_setup("01_torch_estimator_spark", spark=True)),
        md("## The data: one row per image, one column per pixel"),
        code(_DIGITS_FRAME),
        code(_SHOW_DIGITS),
        md(
            """
            ## The estimator

            `RingEstimator` takes the model, the optimizer built on its parameters and the
            loss, as you would write them for one process. `num_proc=2` trains on two Spark
            tasks; `validation=0.2` holds out a fifth of the training rows; the `Store`
            holds the Parquet data the workers read and the run's checkpoints.
            """
        ),
        code(
            """
            import torch

            from estimators import RingEstimator, Store

            EPOCHS = 3 if QUICK else 15
            torch.manual_seed(7)
            model = torch.nn.Sequential(
                torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
            )
            store = Store.create(os.path.join(WORK_DIR, "store"))
            estimator = RingEstimator(
                model=model,
                optimizer=torch.optim.Adam(model.parameters(), lr=3e-3),
                loss=torch.nn.CrossEntropyLoss(),
                metrics=["accuracy"],
                feature_cols=["features"],
                label_cols=["label"],
                batch_size=32,
                epochs=EPOCHS,
                num_proc=2,
                validation=0.2,
                store=store,
                random_seed=7,
            )
            """
        ),
        md(
            """
            ## Fit

            The data goes to Parquet under the store, two Spark tasks form the ring and
            train; one line per epoch appears here as the epochs finish. Rank 0 writes a
            checkpoint after every epoch: a fit with the same `run_id` resumes from it.
            """
        ),
        code(
            """
            ring_model = estimator.fit(train_df)
            print("run", ring_model.getRunId(), "checkpoint:", store.get_checkpoint_path(ring_model.getRunId()))
            """
        ),
        md("## Metrics per epoch"),
        code(_PLOT_HISTORY),
        md("## Predict on the executors"),
        code(_TRANSFORM),
        code(_CONFUSION),
        md("## Save and load inside a Pipeline"),
        code(_PIPELINE),
        code(_STOP_SPARK),
    ]


def keras_estimator() -> list:
    return [
        md(
            """
            # Train a Keras model on a Spark DataFrame with `RingEstimator`

            The same as `01_torch_estimator_spark.ipynb`, with a Keras 3 model (TensorFlow
            backend): scikit-learn's digits as a Spark DataFrame → `RingEstimator` training
            a Keras MLP on 2 Spark tasks → per-epoch metrics and their plot → `transform`
            → a confusion matrix → save and load inside a `PipelineModel`. The estimator
            sees a `keras.Model` and runs the Keras loop (`ringcore.keras`) on the workers.
            """
            + _install_md("spark,petastorm,tensorflow")
        ),
        code(_setup("02_keras_estimator_spark", spark=True)),
        md("## The data: one row per image, one column per pixel"),
        code(_DIGITS_FRAME),
        code(_SHOW_DIGITS),
        md(
            """
            ## The estimator

            A compiled-looking Keras setup, passed as params: the model, a Keras optimizer,
            the loss (a name or a Keras loss) and the metrics. The model outputs logits, so
            the loss is told `from_logits=True`.
            """
        ),
        code(
            """
            os.environ.setdefault("KERAS_BACKEND", "tensorflow")
            import keras

            from estimators import RingEstimator, Store

            EPOCHS = 3 if QUICK else 15
            keras.utils.set_random_seed(7)
            model = keras.Sequential(
                [
                    keras.Input(shape=(64,)),
                    keras.layers.Dense(64, activation="relu"),
                    keras.layers.Dense(10),
                ]
            )
            store = Store.create(os.path.join(WORK_DIR, "store"))
            estimator = RingEstimator(
                model=model,
                optimizer=keras.optimizers.Adam(learning_rate=3e-3),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
                feature_cols=["features"],
                label_cols=["label"],
                batch_size=32,
                epochs=EPOCHS,
                num_proc=2,
                validation=0.2,
                store=store,
                random_seed=7,
            )
            """
        ),
        md(
            """
            ## Fit

            Each epoch prints one line as it finishes; rank 0 checkpoints after every epoch.
            """
        ),
        code(
            """
            ring_model = estimator.fit(train_df)
            print("run", ring_model.getRunId())
            """
        ),
        md("## Metrics per epoch"),
        code(_PLOT_HISTORY),
        md("## Predict on the executors"),
        code(_TRANSFORM),
        code(_CONFUSION),
        md("## Save and load inside a Pipeline"),
        code(_PIPELINE),
        code(_STOP_SPARK),
    ]


def ray_trainer() -> list:
    return [
        md(
            """
            # `RingTrainer` on Ray: checkpoints, a failure, and the restart that survives it

            A training loop written as for one process, plus `hvd.init()` and
            `DistributedOptimizer`, runs on 2 Ray workers. Every epoch it reports its
            metrics and a checkpoint. In epoch 2 one worker's process dies (once, on
            purpose); `RingTrainer` shuts the group down, starts a new one and the loop
            resumes from the latest checkpoint. At the end: the metrics dataframe, plotted.

            **Run it** locally (`pip install "ringtrain[ray,notebooks]"`): the notebook
            starts a Ray instance with 2 CPUs bound to this machine. On Databricks it
            starts Ray on the Spark cluster with `ray.util.spark.setup_ray_cluster` and keeps
            the run under `/dbfs/tmp/ringtrain/` (every worker must reach the storage path).
            `RING_NOTEBOOK_QUICK=1` trains for fewer epochs.
            """
        ),
        code(_setup("03_ray_trainer", spark=False)),
        code(
            """
            import ray

            OWN_RAY = not ray.is_initialized()
            if OWN_RAY:
                if ON_DATABRICKS:
                    from ray.util.spark import setup_ray_cluster

                    setup_ray_cluster(max_worker_nodes=2)  # Ray on the Spark cluster's workers
                    ray.init()
                else:  # a Ray instance on this machine only
                    ray.init(address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1")
            print(ray.cluster_resources())
            """
        ),
        md(
            """
            ## The training loop

            Plain PyTorch with Horovod's calls (`ringcore.torch`), and Ray Train's:
            `ray_runner.get_checkpoint()` is the checkpoint to resume from (None on a fresh
            start), `ray_runner.report(metrics, checkpoint=...)` hands one epoch's metrics
            and files to the run. Rank 1 ends its own process with `os._exit(1)` in epoch
            `fail_at_epoch`, but only on the first attempt: a marker file in the run folder
            says it already happened.
            """
        ),
        code(
            """
            def train_loop(config):
                import os
                import tempfile

                import torch
                from sklearn.datasets import load_digits

                import ray_runner
                import ringcore.torch as hvd

                hvd.init()
                torch.manual_seed(0)
                torch.set_num_threads(1)
                images, labels = load_digits(return_X_y=True)
                x = torch.tensor(images / 16.0, dtype=torch.float32)
                y = torch.tensor(labels)
                held_out = torch.arange(len(y)) % 5 == 0  # every fifth image validates
                x_train = x[~held_out][hvd.rank() :: hvd.size()]  # this rank's shard
                y_train = y[~held_out][hvd.rank() :: hvd.size()]
                x_val, y_val = x[held_out], y[held_out]

                model = torch.nn.Sequential(
                    torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10)
                )
                optimizer = torch.optim.SGD(model.parameters(), lr=0.05 * hvd.size(), momentum=0.9)
                start = 0
                checkpoint = ray_runner.get_checkpoint()
                if checkpoint is not None:  # a restarted group resumes here
                    with checkpoint.as_directory() as folder:
                        state = torch.load(os.path.join(folder, "state.pt"))
                    model.load_state_dict(state["model"])
                    optimizer.load_state_dict(state["optimizer"])
                    start = state["epoch"] + 1
                optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                hvd.broadcast_optimizer_state(optimizer, root_rank=0)

                context = ray_runner.get_context()
                marker = os.path.join(context.get_storage_path(), "failure_injected")
                loss_fn = torch.nn.CrossEntropyLoss()
                for epoch in range(start, config["epochs"]):
                    if epoch == config["fail_at_epoch"] and hvd.rank() == 1 and not os.path.exists(marker):
                        open(marker, "w").close()
                        os._exit(1)  # the worker process dies, as on a lost machine
                    model.train()
                    order = torch.randperm(len(y_train), generator=torch.Generator().manual_seed(epoch))
                    for batch in order.split(32):
                        optimizer.zero_grad()
                        loss = loss_fn(model(x_train[batch]), y_train[batch])
                        loss.backward()
                        optimizer.step()
                    model.eval()
                    with torch.no_grad():
                        train_loss = hvd.allreduce(loss_fn(model(x_train), y_train), name="train_loss")
                        logits = model(x_val)
                        val_loss = loss_fn(logits, y_val)
                        val_accuracy = (logits.argmax(1) == y_val).float().mean()
                    metrics = {
                        "epoch": epoch,
                        "train_loss": train_loss.item(),
                        "val_loss": val_loss.item(),
                        "val_accuracy": val_accuracy.item(),
                        "restored_from_epoch": start - 1,
                    }
                    with tempfile.TemporaryDirectory() as folder:
                        if hvd.rank() == 0:
                            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}
                            torch.save(state, os.path.join(folder, "state.pt"))
                        ray_runner.report(metrics, checkpoint=ray_runner.Checkpoint.from_directory(folder))
            """
        ),
        md(
            """
            ## Fit, with one failure allowed

            `FailureConfig(max_failures=1)` allows one restart; `CheckpointConfig(num_to_keep=2)`
            keeps the two latest checkpoints. Each report prints one line; the restart prints
            which rank failed and the checkpoint the new group starts from.
            """
        ),
        code(
            """
            from ray_runner import CheckpointConfig, FailureConfig, RingTrainer, RunConfig, ScalingConfig

            EPOCHS = 4 if QUICK else 12
            trainer = RingTrainer(
                train_loop,
                train_loop_config={"epochs": EPOCHS, "fail_at_epoch": 2},
                scaling_config=ScalingConfig(num_workers=2),
                run_config=RunConfig(
                    name="digits",
                    storage_path=os.path.join(WORK_DIR, "ray_results"),
                    failure_config=FailureConfig(max_failures=1),
                    checkpoint_config=CheckpointConfig(num_to_keep=2),
                ),
            )
            result = trainer.fit()
            print("final metrics:", result.metrics)
            print("latest checkpoint:", result.checkpoint.path)
            """
        ),
        md(
            """
            ## The metrics dataframe

            One row per report of rank 0, in order. Epochs 0 and 1 ran in the first group;
            the failure came in epoch 2, before its report; the second group restored the
            checkpoint of epoch 1 and trained epochs 2 onwards.
            """
        ),
        code(
            """
            import matplotlib.pyplot as plt

            frame = result.metrics_dataframe
            print(frame.round(4).to_string(index=False))
            assert list(frame["epoch"]) == list(range(EPOCHS))  # every epoch once, none lost
            assert (frame["restored_from_epoch"] == 1).sum() == EPOCHS - 2  # the second group's

            fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 3.5))
            ax_loss.plot(frame["epoch"], frame["train_loss"], marker="o", label="train")
            ax_loss.plot(frame["epoch"], frame["val_loss"], marker="o", label="validation")
            ax_acc.plot(frame["epoch"], frame["val_accuracy"], marker="o", color="tab:green")
            for ax in (ax_loss, ax_acc):
                ax.axvline(1.5, color="tab:red", linestyle="--", label="worker lost; restored epoch 1")
                ax.set_xlabel("epoch")
            ax_loss.set_title("loss")
            ax_acc.set_title("validation accuracy")
            ax_loss.legend()
            fig.tight_layout()
            fig.savefig(os.path.join(WORK_DIR, "ray_metrics.png"))
            plt.show()
            """
        ),
        code(
            """
            if OWN_RAY and not ON_DATABRICKS:
                ray.shutdown()
            """
        ),
    ]


_HOROVOD_SCRIPT = '''
HOROVOD_SCRIPT = """\\
import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler

import horovod.torch as hvd


def metric_average(value, name):
    return hvd.allreduce(torch.tensor(value), name=name).item()


def main(epochs=5, batch_size=32, lr=0.01):
    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)

    images, labels = load_digits(return_X_y=True)
    dataset = TensorDataset(torch.tensor(images / 16.0, dtype=torch.float32), torch.tensor(labels))
    sampler = DistributedSampler(dataset, num_replicas=hvd.size(), rank=hvd.rank())
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=lr * hvd.size(), momentum=0.9)
    optimizer = hvd.DistributedOptimizer(
        optimizer,
        named_parameters=model.named_parameters(),
        compression=hvd.Compression.fp16,
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    history = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        total, correct, seen = 0.0, 0, 0
        for data, target in loader:
            optimizer.zero_grad()
            output = model(data)
            loss = F.cross_entropy(output, target)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(target)
            correct += (output.argmax(1) == target).sum().item()
            seen += len(target)
        loss_avg = metric_average(total / seen, "avg_loss")
        accuracy = metric_average(correct / seen, "avg_accuracy")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: loss {loss_avg:.4f} accuracy {accuracy:.4f}", flush=True)
        history.append({"epoch": epoch, "loss": loss_avg, "accuracy": accuracy})
    return {"rank": hvd.rank(), "size": hvd.size(), "history": history}
"""
print(HOROVOD_SCRIPT)
'''


def horovod_migration() -> list:
    return [
        md(
            """
            # Run a Horovod PyTorch script on ringtrain: change one import

            A typical Horovod training script (`hvd.init`, `DistributedSampler` by rank,
            the learning rate scaled by `hvd.size()`, `DistributedOptimizer` with fp16
            compression, broadcast of the initial state, metrics averaged with
            `hvd.allreduce`) — and the one line that changes to run it on `ringcore.torch`.
            Where Horovod launched it with `horovod.spark.run(main, num_proc=2)`, ringtrain
            launches it with `spark_runner.run(main, num_proc=2)`.
            """
            + _install_md("spark")
        ),
        code(_setup("04_horovod_migration", spark=True)),
        md("## The Horovod script, as it was"),
        code(_HOROVOD_SCRIPT),
        md(
            """
            ## The migration: one line

            Nothing else changes. The script is written beside the notebook (as a
            `train.py` would be) and imported; `spark_runner.run` ships a module that is
            not an installed package to the workers by value.
            """
        ),
        code(
            """
            import difflib
            import sys

            script = HOROVOD_SCRIPT.replace("import horovod.torch as hvd", "import ringcore.torch as hvd")
            changed = [
                line
                for line in difflib.unified_diff(HOROVOD_SCRIPT.splitlines(), script.splitlines(), lineterm="", n=0)
                if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
            ]
            print("\\n".join(changed))
            assert len(changed) == 2  # one line out, one line in

            with open(os.path.join(WORK_DIR, "train_digits_hvd.py"), "w") as f:
                f.write(script)
            sys.path.insert(0, WORK_DIR)
            import train_digits_hvd
            """
        ),
        md(
            """
            ## Launch: `horovod.spark.run` → `spark_runner.run`

            Two Spark tasks of one barrier stage form the ring. Worker output reaches this
            notebook live, each line prefixed with its rank; the results come back ordered
            by rank.
            """
        ),
        code(
            """
            import spark_runner

            EPOCHS = 3 if QUICK else 10
            results = spark_runner.run(train_digits_hvd.main, kwargs={"epochs": EPOCHS}, num_proc=2)
            for r in results:
                print(f"rank {r['rank']} of {r['size']}: final accuracy {r['history'][-1]['accuracy']:.4f}")
            assert [r["rank"] for r in results] == [0, 1]
            # the metrics were averaged over the ranks: every rank holds the same numbers
            assert results[0]["history"] == results[1]["history"]
            """
        ),
        code(
            """
            import matplotlib.pyplot as plt
            import pandas as pd

            history = pd.DataFrame(results[0]["history"])
            fig, ax = plt.subplots(figsize=(6, 3.5))
            ax.plot(history["epoch"], history["loss"], marker="o", label="loss")
            ax.plot(history["epoch"], history["accuracy"], marker="o", label="accuracy")
            ax.set(xlabel="epoch", title="the Horovod script on ringcore.torch, 2 Spark tasks")
            ax.legend()
            fig.savefig(os.path.join(WORK_DIR, "horovod_script.png"))
            plt.show()
            """
        ),
        md(
            """
            The same script also runs, unchanged, under `ray_runner.RayExecutor(num_workers=2)`
            (`executor.run(main)`), `torchrun --nproc-per-node 2`, or `mpirun -np 2`: every
            launcher sets one set of `RING_*` variables (or its own, which `hvd.init()` also
            reads). See `docs/migrating-from-horovod.md` for every Horovod name.
            """
        ),
        code(_STOP_SPARK),
    ]


def timeline() -> list:
    return [
        md(
            """
            # Record a timeline of a training run and draw it

            `RING_TIMELINE=<file>` makes rank 0 write a Chrome-trace JSON file with one row
            per tensor (`allreduce.<name>`, as Horovod names it) and its phases:
            `NEGOTIATE_ALLREDUCE` (submitted, waiting for every rank to submit it), `QUEUE` (agreed, waiting for the engine thread),
            `MEMCPY_IN_FUSION_BUFFER`, the collective (`ALLREDUCE`, `BROADCAST`, ...) and
            `MEMCPY_OUT_FUSION_BUFFER`. `RING_TIMELINE_MARK_CYCLES=1` marks each batch of
            responses the coordinator sent. Here a small model trains for a few steps on 2
            Spark tasks with the timeline on; then the file is drawn with matplotlib.
            """
            + _install_md("spark")
        ),
        code(_setup("05_timeline", spark=True)),
        code(
            """
            def train(steps):
                import torch

                import ringcore.torch as hvd

                hvd.init()
                torch.manual_seed(0)
                torch.set_num_threads(1)
                model = torch.nn.Sequential(
                    torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                    torch.nn.ReLU(), torch.nn.Linear(256, 10),
                )
                optimizer = hvd.DistributedOptimizer(
                    torch.optim.SGD(model.parameters(), lr=0.01),
                    named_parameters=model.named_parameters(),
                )
                hvd.broadcast_parameters(model.state_dict(), root_rank=0)
                for step in range(steps):
                    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
                    optimizer.zero_grad()
                    torch.nn.functional.cross_entropy(model(x), y).backward()
                    optimizer.step()
                return hvd.rank()
            """
        ),
        md(
            """
            ## Train with the timeline on

            On Databricks rank 0 runs on an executor, so the file goes to `/dbfs/...`
            where the driver can read it.
            """
        ),
        code(
            """
            import spark_runner

            STEPS = 5 if QUICK else 20
            timeline_path = os.path.join(WORK_DIR, "timeline.json")
            ranks = spark_runner.run(
                train,
                args=(STEPS,),
                num_proc=2,
                env={"RING_TIMELINE": timeline_path, "RING_TIMELINE_MARK_CYCLES": "1"},
            )
            print("ranks", ranks, "wrote", timeline_path, os.path.getsize(timeline_path), "bytes")
            """
        ),
        md(
            """
            ## Read it

            The file is a JSON array of trace events: `M` events name a row (`tid`) after a
            tensor, `X` events are one phase of one tensor (`ts` and `dur` in microseconds),
            `i` events mark cycles.
            """
        ),
        code(
            """
            import json

            import pandas as pd

            with open(timeline_path) as f:
                events = json.load(f)
            rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
            spans = pd.DataFrame(
                [
                    {"tensor": rows[e["tid"]], "phase": e["name"], "start_ms": e["ts"] / 1e3, "ms": e["dur"] / 1e3}
                    for e in events
                    if e["ph"] == "X"
                ]
            )
            cycles = [e["ts"] / 1e3 for e in events if e["ph"] == "i"]
            print(f"{len(rows)} tensors, {len(spans)} phases, {len(cycles)} cycles")
            summary = spans.groupby("phase")["ms"].agg(["count", "sum", "mean"]).round(3)
            print(summary.sort_values("sum", ascending=False).to_string())
            assert {"NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE", "BROADCAST"} <= set(spans["phase"])
            """
        ),
        md(
            """
            ## Draw it

            One row per tensor, one colour per phase, over the last training steps. The
            gradients of one step are fused: their `ALLREDUCE` bars line up, framed by the
            copies into and out of the fusion buffer.
            """
        ),
        code(
            """
            import matplotlib.pyplot as plt

            colors = {
                "NEGOTIATE_ALLREDUCE": "tab:gray",
                "NEGOTIATE_BROADCAST": "tab:gray",
                "QUEUE": "tab:olive",
                "MEMCPY_IN_FUSION_BUFFER": "tab:orange",
                "ALLREDUCE": "tab:blue",
                "MEMCPY_OUT_FUSION_BUFFER": "tab:purple",
                "BROADCAST": "tab:green",
            }
            grads = spans[spans["tensor"].str.startswith("allreduce.")]
            window_start = grads["start_ms"].quantile(0.6)  # the last steps, where it is steady
            shown = spans[spans["start_ms"] >= window_start]
            tensors = sorted(shown["tensor"].unique())
            fig, ax = plt.subplots(figsize=(11, 0.45 * len(tensors) + 1.5))
            for row, name in enumerate(tensors):
                mine = shown[shown["tensor"] == name]
                for phase, part in mine.groupby("phase"):
                    ax.broken_barh(
                        list(zip(part["start_ms"], part["ms"])), (row - 0.4, 0.8),
                        color=colors.get(phase, "tab:red"), label=phase,
                    )
            for t in cycles:
                if t >= window_start:
                    ax.axvline(t, color="black", alpha=0.15, linewidth=0.8)
            handles, labels_ = ax.get_legend_handles_labels()
            unique = dict(zip(labels_, handles))
            ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1, 1))
            ax.set_yticks(range(len(tensors)), tensors)
            ax.set_xlabel("ms since the timeline started")
            ax.set_title("rank 0's timeline: phases per tensor (thin lines: coordinator cycles)")
            fig.tight_layout()
            fig.savefig(os.path.join(WORK_DIR, "timeline.png"))
            plt.show()
            """
        ),
        md(
            """
            ## Open it in Perfetto

            Go to <https://ui.perfetto.dev>, choose **Open trace file** and pick
            `timeline.json` (on Databricks, download it from `/dbfs/tmp/ringtrain/05_timeline/`
            first). `chrome://tracing` in Chrome opens it too (**Load**). Each tensor is a
            row; click a bar for its phase and duration. In a script, `hvd.start_timeline(path)`
            / `hvd.stop_timeline()` record only part of a run.
            """
        ),
        code(_STOP_SPARK),
    ]


NOTEBOOKS = {
    "01_torch_estimator_spark.ipynb": torch_estimator,
    "02_keras_estimator_spark.ipynb": keras_estimator,
    "03_ray_trainer.ipynb": ray_trainer,
    "04_horovod_migration.ipynb": horovod_migration,
    "05_timeline.ipynb": timeline,
}


def build(name: str) -> str:
    """The notebook ``name`` as the JSON text this script stores."""
    nb = new_notebook(
        cells=NOTEBOOKS[name](),
        metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}},
    )
    for index, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{index:02d}"  # stable ids: a rebuild changes nothing
    nbformat.validate(nb)
    return nbformat.writes(nb) + "\n"


def main() -> int:
    for name in NOTEBOOKS:
        (HERE / name).write_text(build(name))
        print("wrote", HERE / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
