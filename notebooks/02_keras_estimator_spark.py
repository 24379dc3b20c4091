# %% [markdown]
# # Train a Keras model on a Spark DataFrame with `RingEstimator`
#
# The same as `01_torch_estimator_spark.ipynb`, with a Keras 3 model (TensorFlow
# backend): scikit-learn's digits as a Spark DataFrame → `RingEstimator` training
# a Keras MLP on 2 Spark tasks → per-epoch metrics and their plot → `transform`
# → a confusion matrix → save and load inside a `PipelineModel`. The estimator
# sees a `keras.Model` and runs the Keras loop (`ringcore.keras`) on the workers.
#
# **Run it** in a local Jupyter (`pip install "ringtrain[spark,petastorm,tensorflow,notebooks]"`) or on
# Databricks (a cluster with ringtrain installed, e.g. `%pip install "ringtrain[spark,petastorm,tensorflow]"`
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
        "local[2]", app_name="ringtrain-02_keras_estimator_spark", log_level="ERROR"
    )
    OWN_SPARK = True

# Files every worker must reach: a Unity Catalog volume on Databricks, a temporary
# directory here.
WORK_DIR = (
    os.path.join(
        os.environ.get("RING_NOTEBOOK_VOLUME", "/Volumes/main/default/ringtrain"),
        "02_keras_estimator_spark",
    )
    if ON_DATABRICKS
    else tempfile.mkdtemp(prefix="ringtrain-02_keras_estimator_spark-")
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
# A compiled-looking Keras setup, passed as params: the model, a Keras optimizer,
# the loss (a name or a Keras loss) and the metrics. The model outputs logits, so
# the loss is told `from_logits=True`.

# %%
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

# %% [markdown]
# ## Fit
#
# Each epoch prints one line as it finishes; rank 0 checkpoints after every epoch.

# %%
ring_model = estimator.fit(train_df)
print("run", ring_model.getRunId())

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
