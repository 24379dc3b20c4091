# %% [markdown]
# # Record a timeline of a training run and draw it
#
# `RING_TIMELINE=<file>` makes rank 0 write a Chrome-trace JSON file with one row
# per tensor (`allreduce.<name>`, as Horovod names it) and its phases:
# `NEGOTIATE_ALLREDUCE` (submitted, waiting for every rank to submit it), `QUEUE` (agreed, waiting for the engine thread),
# `MEMCPY_IN_FUSION_BUFFER`, the collective (`ALLREDUCE`, `BROADCAST`, ...) and
# `MEMCPY_OUT_FUSION_BUFFER`. `RING_TIMELINE_MARK_CYCLES=1` marks each batch of
# responses the coordinator sent. Here a small model trains for a few steps on 2
# Spark tasks with the timeline on; then the file is drawn with matplotlib.
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
        "local[2]", app_name="ringtrain-05_timeline", log_level="ERROR"
    )
    OWN_SPARK = True

# Files every worker must reach: a Unity Catalog volume on Databricks, a temporary
# directory here.
WORK_DIR = (
    os.path.join(
        os.environ.get("RING_NOTEBOOK_VOLUME", "/Volumes/main/default/ringtrain"), "05_timeline"
    )
    if ON_DATABRICKS
    else tempfile.mkdtemp(prefix="ringtrain-05_timeline-")
)
os.makedirs(WORK_DIR, exist_ok=True)
print(f"Spark {spark.version}; files under {WORK_DIR}")


# %%
def train(steps):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    optimizer = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        named_parameters=model.named_parameters(),
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    for _step in range(steps):
        x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return hvd.rank()


# %% [markdown]
# ## Train with the timeline on
#
# On Databricks rank 0 runs on an executor, so the file goes to the volume
# (`/Volumes/...`), where the driver can read it.

# %%
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

# %% [markdown]
# ## Read it
#
# The file is a JSON array of trace events: `M` events name a row (`tid`) after a
# tensor, `X` events are one phase of one tensor (`ts` and `dur` in microseconds),
# `i` events mark cycles.

# %%
import json

import pandas as pd

with open(timeline_path) as f:
    events = json.load(f)
rows = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
spans = pd.DataFrame(
    [
        {
            "tensor": rows[e["tid"]],
            "phase": e["name"],
            "start_ms": e["ts"] / 1e3,
            "ms": e["dur"] / 1e3,
        }
        for e in events
        if e["ph"] == "X"
    ]
)
cycles = [e["ts"] / 1e3 for e in events if e["ph"] == "i"]
print(f"{len(rows)} tensors, {len(spans)} phases, {len(cycles)} cycles")
summary = spans.groupby("phase")["ms"].agg(["count", "sum", "mean"]).round(3)
print(summary.sort_values("sum", ascending=False).to_string())
assert {"NEGOTIATE_ALLREDUCE", "QUEUE", "ALLREDUCE", "BROADCAST"} <= set(spans["phase"])

# %% [markdown]
# ## Draw it
#
# One row per tensor, one colour per phase, over the last training steps. The
# gradients of one step are fused: their `ALLREDUCE` bars line up, framed by the
# copies into and out of the fusion buffer.

# %%
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
            list(zip(part["start_ms"], part["ms"])),
            (row - 0.4, 0.8),
            color=colors.get(phase, "tab:red"),
            label=phase,
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

# %% [markdown]
# ## Open it in Perfetto
#
# Go to <https://ui.perfetto.dev>, choose **Open trace file** and pick
# `timeline.json` (on Databricks, download it from the volume's `05_timeline/` folder
# first, in Catalog Explorer). `chrome://tracing` in Chrome opens it too (**Load**). Each tensor is a
# row; click a bar for its phase and duration. In a script, `hvd.start_timeline(path)`
# / `hvd.stop_timeline()` record only part of a run.

# %%
if OWN_SPARK:  # never stop the session Databricks gave the notebook
    spark.stop()
