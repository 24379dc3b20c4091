# %% [markdown]
# # Train a PyTorch model on a Spark DataFrame with `RingEstimator`
#
# scikit-learn's digits (8x8 images, bundled: nothing to download) as a Spark
# DataFrame → `RingEstimator` training a small PyTorch MLP on 2 Spark tasks with a
# ring allreduce → per-epoch metrics and their plot → `transform` on the executors
# → a confusion matrix → the fitted model saved and loaded inside a Spark ML
# `PipelineModel`.
#
# **Run it** in a local Jupyter (`pip install "ringtrain[spark,petastorm,notebooks]"`) or on
# Databricks (a cluster with ringtrain installed, e.g. `%pip install "ringtrain[spark,petastorm]"`
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
        "local[2]", app_name="ringtrain-01_torch_estimator_spark", log_level="ERROR"
    )
    OWN_SPARK = True

# Files every worker must reach: a Unity Catalog volume on Databricks, a temporary
# directory here.
WORK_DIR = (
    os.path.join(
        os.environ.get("RING_NOTEBOOK_VOLUME", "/Volumes/main/default/ringtrain"),
        "01_torch_estimator_spark",
    )
    if ON_DATABRICKS
    else tempfile.mkdtemp(prefix="ringtrain-01_torch_estimator_spark-")
)
os.makedirs(WORK_DIR, exist_ok=True)
print(f"Spark {spark.version}; files under {WORK_DIR}")

# %% [markdown]
# ## The data: one row per image, one column per pixel

# %%
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

# %%
import matplotlib.pyplot as plt

fig, axes = plt.subplots(1, 10, figsize=(10, 1.4))
for ax, image, label in zip(axes, images, labels):
    ax.imshow(image.reshape(8, 8), cmap="gray_r")
    ax.set_title(str(label))
    ax.axis("off")
plt.show()

# %% [markdown]
# ## The estimator
#
# `RingEstimator` takes the model, the optimizer built on its parameters and the
# loss, as you would write them for one process. `num_proc=2` trains on two Spark
# tasks; `validation=0.2` holds out a fifth of the training rows; the `Store`
# holds the Parquet data the workers read and the run's checkpoints.

# %%
import torch

from estimators import RingEstimator, Store

EPOCHS = 3 if QUICK else 15
torch.manual_seed(7)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
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

# %% [markdown]
# ## Fit
#
# The data goes to Parquet under the store, two Spark tasks form the ring and
# train; a progress bar follows rank 0's steps (loss, rows per second) and one line
# per epoch appears here as the epochs finish (`progress=False`, or
# `RING_PROGRESS=0`, turns the bar off). Rank 0 writes a checkpoint after every
# epoch: a fit with the same `run_id` resumes from it.

# %%
ring_model = estimator.fit(train_df)
print("run", ring_model.getRunId(), "checkpoint:", store.get_checkpoint_path(ring_model.getRunId()))

# %% [markdown]
# ## Metrics per epoch

# %%
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

# %% [markdown]
# ## TensorBoard curves
#
# Rank 0 also wrote TensorBoard event files under the run's logs folder in the store
# (`<store>/runs/<run_id>/logs`): the loss of every step and every epoch's metrics.
# `tensorboard --logdir <that folder>` shows them; here they are read back without a
# server.

# %%
from estimators import read_tensorboard_scalars

scalars = read_tensorboard_scalars(store, ring_model.getRunId())
print("tags:", ", ".join(sorted(scalars)))
fig, (ax_step, ax_epoch) = plt.subplots(1, 2, figsize=(10, 3.5))
steps, values = zip(*scalars["step/loss"])
ax_step.plot(steps, values, linewidth=0.8)
ax_step.set(title="loss per step (rank 0)", xlabel="step")
for tag in ("epoch/train_loss", "epoch/val_loss"):
    epochs, values = zip(*scalars[tag])
    ax_epoch.plot(epochs, values, marker="o", label=tag.split("/")[1])
ax_epoch.set(title="loss per epoch", xlabel="epoch")
ax_epoch.legend()
fig.tight_layout()
fig.savefig(os.path.join(WORK_DIR, "tensorboard.png"))
plt.show()
assert [e for e, _ in scalars["epoch/train_loss"]] == list(range(1, EPOCHS + 1))

# %% [markdown]
# ## Predict on the executors

# %%
# transform() runs the model on the executors in Arrow batches and appends
# `label__output`: the 10 logits of each row.
scored = ring_model.transform(test_df).select("id", "label", "label__output")
result = scored.toPandas().sort_values("id").reset_index(drop=True)
logits = np.stack(result["label__output"])
predicted = logits.argmax(axis=1)
accuracy = float((predicted == result["label"]).mean())
print(f"test accuracy: {accuracy:.3f} on {len(result)} rows")
assert accuracy > 0.5, accuracy

# %%
from sklearn.metrics import ConfusionMatrixDisplay, confusion_matrix

matrix = confusion_matrix(result["label"], predicted, labels=list(range(10)))
fig, ax = plt.subplots(figsize=(5, 5))
ConfusionMatrixDisplay(matrix, display_labels=list(range(10))).plot(ax=ax, colorbar=False)
ax.set_title("test set: true vs predicted digit")
fig.savefig(os.path.join(WORK_DIR, "confusion.png"))
plt.show()

# %% [markdown]
# ## Save and load inside a Pipeline

# %%
from pyspark.ml import PipelineModel

# The fitted model is a Spark ML Model: it goes into a PipelineModel beside the
# VectorAssembler, and the pipeline saves and loads as any other.
pipeline = PipelineModel(stages=[assembler, ring_model])
# Spark reads a volume by its /Volumes path; here "file:" keeps it on the local disk.
pipeline_path = os.path.join(WORK_DIR, "digits_pipeline")
if not ON_DATABRICKS:
    pipeline_path = "file:" + pipeline_path
pipeline.write().overwrite().save(pipeline_path)

loaded = PipelineModel.load(pipeline_path)
again = loaded.transform(test_raw).select("id", "label__output").toPandas().sort_values("id")
same = np.allclose(np.stack(again["label__output"]), logits)
print(f"{type(loaded.stages[-1]).__name__} loaded from {pipeline_path}; same outputs: {same}")
assert same

# %%
if OWN_SPARK:  # never stop the session Databricks gave the notebook
    spark.stop()
