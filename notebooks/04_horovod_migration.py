# %% [markdown]
# # Run a Horovod PyTorch script on ringtrain: change one import
#
# A typical Horovod training script (`hvd.init`, `DistributedSampler` by rank,
# the learning rate scaled by `hvd.size()`, `DistributedOptimizer` with fp16
# compression, broadcast of the initial state, metrics averaged with
# `hvd.allreduce`) — and the one line that changes to run it on `ringcore.torch`.
# Where Horovod launched it with `horovod.spark.run(main, num_proc=2)`, ringtrain
# launches it with `spark_runner.run(main, num_proc=2)`.
#
# **Run it** in a local Jupyter (`pip install "ringtrain[spark,notebooks]"`) or on
# Databricks (a cluster with ringtrain installed, e.g. `%pip install "ringtrain[spark]"`
# in the first cell). On Databricks the notebook uses the cluster's `spark` (classic,
# shared-access or serverless: it never touches the SparkContext) and writes under a Unity
# Catalog volume, `RING_NOTEBOOK_VOLUME` or `/Volumes/main/default/ringtrain` (make it
# with `CREATE VOLUME main.default.ringtrain`); elsewhere it starts `local[2]` and writes
# to a temporary directory. `RING_NOTEBOOK_QUICK=1` trains for fewer epochs (the tests set it).

# %%
import os
import tempfile

# RING_NOTEBOOK_QUICK=1 (tests/end_to_end/test_notebooks.py sets it) trains for fewer epochs.
QUICK = os.environ.get("RING_NOTEBOOK_QUICK") == "1"
ON_DATABRICKS = "DATABRICKS_RUNTIME_VERSION" in os.environ

# Databricks gives every notebook a `spark`; anywhere else, build a local one.
try:
    spark  # noqa: B018
    OWN_SPARK = False
except NameError:
    import spark_runner

    spark = spark_runner.local_session(
        "local[2]", app_name="ringtrain-04_horovod_migration", log_level="ERROR"
    )
    OWN_SPARK = True

# Files every worker must reach: a Unity Catalog volume on Databricks, a temporary
# directory here.
WORK_DIR = (
    os.path.join(
        os.environ.get("RING_NOTEBOOK_VOLUME", "/Volumes/main/default/ringtrain"),
        "04_horovod_migration",
    )
    if ON_DATABRICKS
    else tempfile.mkdtemp(prefix="ringtrain-04_horovod_migration-")
)
os.makedirs(WORK_DIR, exist_ok=True)
print(f"Spark {spark.version}; files under {WORK_DIR}")

# %% [markdown]
# ## The Horovod script, as it was

# %%
HOROVOD_SCRIPT = """\
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

# %% [markdown]
# ## The migration: one line
#
# Nothing else changes. The script is written beside the notebook (as a
# `train.py` would be) and imported; `spark_runner.run` ships a module that is
# not an installed package to the workers by value.

# %%
import difflib
import sys

script = HOROVOD_SCRIPT.replace("import horovod.torch as hvd", "import ringcore.torch as hvd")
changed = [
    line
    for line in difflib.unified_diff(
        HOROVOD_SCRIPT.splitlines(), script.splitlines(), lineterm="", n=0
    )
    if line.startswith(("+", "-")) and not line.startswith(("+++", "---"))
]
print("\n".join(changed))
assert len(changed) == 2  # one line out, one line in

with open(os.path.join(WORK_DIR, "train_digits_hvd.py"), "w") as f:
    f.write(script)
sys.path.insert(0, WORK_DIR)
import train_digits_hvd

# %% [markdown]
# ## Launch: `horovod.spark.run` → `spark_runner.run`
#
# Two Spark tasks of one barrier stage form the ring. Worker output reaches this
# notebook live, each line prefixed with its rank; the results come back ordered
# by rank.
# %%
import spark_runner

EPOCHS = 3 if QUICK else 10
results = spark_runner.run(train_digits_hvd.main, kwargs={"epochs": EPOCHS}, num_proc=2)
for r in results:
    print(f"rank {r['rank']} of {r['size']}: final accuracy {r['history'][-1]['accuracy']:.4f}")
assert [r["rank"] for r in results] == [0, 1]
# the metrics were averaged over the ranks: every rank holds the same numbers
assert results[0]["history"] == results[1]["history"]

# %%
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

# %% [markdown]
# The same script also runs, unchanged, under `ray_runner.RayExecutor(num_workers=2)`
# (`executor.run(main)`), `torchrun --nproc-per-node 2`, or `mpirun -np 2`: every
# launcher sets one set of `RING_*` variables (or its own, which `hvd.init()` also
# reads). See `docs/migrating-from-horovod.md` for every Horovod name.

# %%
if OWN_SPARK:  # never stop the session Databricks gave the notebook
    spark.stop()
