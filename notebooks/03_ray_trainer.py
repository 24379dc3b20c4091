# %% [markdown]
# # `RingTrainer` on Ray: checkpoints, a failure, and the restart that survives it
#
# A training loop written as for one process, plus `hvd.init()` and
# `DistributedOptimizer`, runs on 2 Ray workers. Every epoch it reports its
# metrics and a checkpoint. In epoch 2 one worker's process dies (once, on
# purpose); `RingTrainer` shuts the group down, starts a new one and the loop
# resumes from the latest checkpoint. At the end: the metrics dataframe, plotted.
#
# **Run it** locally (`pip install "ringtrain[ray,notebooks]"`): the notebook
# starts a Ray instance with 2 CPUs bound to this machine. On Databricks it
# starts Ray on the Spark cluster with `ray.util.spark.setup_ray_cluster` (and shuts it
# down at the end) and keeps the run under a Unity Catalog volume, `RING_NOTEBOOK_VOLUME`
# or `/Volumes/main/default/ringtrain` (every worker must reach the storage path).
# `RING_NOTEBOOK_QUICK=1` trains for fewer epochs.

# %%
import os
import tempfile

# RING_NOTEBOOK_QUICK=1 (tests/end_to_end/test_notebooks.py sets it) trains for fewer epochs.
QUICK = os.environ.get("RING_NOTEBOOK_QUICK") == "1"
ON_DATABRICKS = "DATABRICKS_RUNTIME_VERSION" in os.environ

# Files every worker must reach: a Unity Catalog volume on Databricks, a temporary
# directory here.
WORK_DIR = (
    os.path.join(
        os.environ.get("RING_NOTEBOOK_VOLUME", "/Volumes/main/default/ringtrain"), "03_ray_trainer"
    )
    if ON_DATABRICKS
    else tempfile.mkdtemp(prefix="ringtrain-03_ray_trainer-")
)
os.makedirs(WORK_DIR, exist_ok=True)
print(f"files under {WORK_DIR}")

# %%
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


# %% [markdown]
# ## The training loop
#
# Plain PyTorch with Horovod's calls (`ringcore.torch`), and Ray Train's:
# `ray_runner.get_checkpoint()` is the checkpoint to resume from (None on a fresh
# start), `ray_runner.report(metrics, checkpoint=...)` hands one epoch's metrics
# and files to the run. Rank 1 ends its own process with `os._exit(1)` in epoch
# `fail_at_epoch`, but only on the first attempt: a marker file in the run folder
# says it already happened.


# %%
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

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
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
                state = {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "epoch": epoch,
                }
                torch.save(state, os.path.join(folder, "state.pt"))
            ray_runner.report(metrics, checkpoint=ray_runner.Checkpoint.from_directory(folder))


# %% [markdown]
# ## Fit, with one failure allowed
#
# `FailureConfig(max_failures=1)` allows one restart; `CheckpointConfig(num_to_keep=2)`
# keeps the two latest checkpoints. Each report prints one line; the restart prints
# which rank failed and the checkpoint the new group starts from.

# %%
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

# %% [markdown]
# ## The metrics dataframe
#
# One row per report of rank 0, in order. Epochs 0 and 1 ran in the first group;
# the failure came in epoch 2, before its report; the second group restored the
# checkpoint of epoch 1 and trained epochs 2 onwards.

# %%
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

# %%
if OWN_RAY:
    ray.shutdown()
    if ON_DATABRICKS:  # the Ray cluster this notebook started on the Spark workers
        from ray.util.spark import shutdown_ray_cluster

        shutdown_ray_cluster()
