# %% [markdown]
# # Fine-tune a transformer from a Spark DataFrame, sharded with FSDP
#
# A text column of a Spark DataFrame → a Hugging Face `BertForSequenceClassification`
# trained by `RingEstimator` on 2 Spark tasks with `strategy="fsdp"` (FSDP2: each worker
# holds a shard of every parameter, gradient and optimizer state; each encoder layer is
# a unit of its own) → its loss per epoch and the sharded checkpoint each worker wrote →
# `transform` on the executors → the fitted model saved in Hugging Face's own format and
# loaded back.
#
# The model is built from a config and the tokenizer from a vocabulary written here:
# nothing is downloaded. With a pretrained checkpoint, pass
# `AutoModelForSequenceClassification.from_pretrained(...)` and its `AutoTokenizer`
# instead: the estimator's call is the same.
#
# **Run it** in a local Jupyter (`pip install "ringtrain[spark,transformers,notebooks]"`)
# or on Databricks (a cluster with ringtrain installed). On Databricks the notebook uses
# the cluster's `spark` and writes under a Unity Catalog volume, `RING_NOTEBOOK_VOLUME`
# or `/Volumes/main/default/ringtrain`; elsewhere it starts `local[2]` and writes to a
# temporary directory. `RING_NOTEBOOK_QUICK=1` trains for fewer epochs (the tests set it).

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
        "local[2]", app_name="ringtrain-06_transformer_fsdp", log_level="ERROR"
    )
    OWN_SPARK = True

# Files every worker must reach: a Unity Catalog volume on Databricks, a temporary
# directory here.
WORK_DIR = (
    os.path.join(
        os.environ.get("RING_NOTEBOOK_VOLUME", "/Volumes/main/default/ringtrain"),
        "06_transformer_fsdp",
    )
    if ON_DATABRICKS
    else tempfile.mkdtemp(prefix="ringtrain-06_transformer_fsdp-")
)
os.makedirs(WORK_DIR, exist_ok=True)
print(f"Spark {spark.version}; files under {WORK_DIR}")

# %% [markdown]
# ## The data: short reviews and whether they are positive
#
# Generated here: a review is 3 to 8 words; it is positive (label 1) when it says
# "great" more often than "awful". A rule a tiny model learns in a few epochs.

# %%
import numpy as np

WORDS = ["the", "food", "service", "room", "was", "and", "very", "quite", "staff", "view"]
GOOD, BAD = "great", "awful"


def reviews(seed: int, rows: int) -> list[tuple[str, int]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        words = list(rng.choice(WORDS, size=rng.integers(3, 9)))
        for _ in range(rng.integers(1, 3)):
            words.insert(rng.integers(0, len(words) + 1), GOOD if rng.random() < 0.5 else BAD)
        out.append((" ".join(words), int(words.count(GOOD) > words.count(BAD))))
    return out


train_df = spark.createDataFrame(reviews(0, 1024), "text string, label int")
test_df = spark.createDataFrame(reviews(1, 256), "text string, label int")
train_df.show(5, truncate=False)

# %% [markdown]
# ## A tokenizer and a BERT, both from scratch

# %%
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate([*WORDS, GOOD, BAD])}}
words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
words.pre_tokenizer = Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]")

torch.manual_seed(0)
config = BertConfig(
    vocab_size=len(vocab),
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    intermediate_size=128,
    max_position_embeddings=16,
    num_labels=2,
)
model = BertForSequenceClassification(config)
print(
    f"{sum(p.numel() for p in model.parameters()):,} parameters, {config.num_hidden_layers} layers"
)

# %% [markdown]
# ## Fit with `strategy="fsdp"`
#
# The text column is tokenized on the workers (`tokenizer=`, padded to `max_length`),
# the model is called with `input_ids` and `attention_mask` by name and the label as
# `labels=`; `loss=None` trains on the model's own loss. Under `fsdp` every epoch each
# worker writes its shard of the model and optimizer state to the store.

# %%
from estimators import RingEstimator, Store

store = Store.create(os.path.join(WORK_DIR, "store"))
estimator = RingEstimator(
    model=model,
    optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3),
    loss=None,  # the model's own loss: outputs.loss
    tokenizer=tokenizer,
    max_length=12,
    feature_cols=["text"],
    label_cols=["label"],
    strategy="fsdp",
    num_proc=2,
    batch_size=32,
    epochs=3 if QUICK else 6,
    validation=0.1,
    store=store,
    random_seed=1,
    verbose=0,
)
ring_model = estimator.fit(train_df)
history = ring_model.getHistory()
for entry in history:
    print({k: round(v, 4) if isinstance(v, float) else v for k, v in entry.items()})

# %%
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(5, 3))
epochs = [e["epoch"] for e in history]
ax.plot(epochs, [e["train_loss"] for e in history], marker="o", label="train")
ax.plot(epochs, [e["val_loss"] for e in history], marker="o", label="validation")
ax.set_xlabel("epoch")
ax.set_ylabel("loss")
ax.legend()
fig.savefig(os.path.join(WORK_DIR, "loss.png"))
plt.show()

# %% [markdown]
# ## The sharded checkpoint: one file per worker
#
# The store keeps the last two epochs' folders; each holds every worker's shard
# (`torch.distributed.checkpoint`) and resumes on any number of workers.

# %%
import glob

for folder in sorted(glob.glob(os.path.join(WORK_DIR, "store", "runs", "*", "sharded", "*"))):
    print(os.path.relpath(folder, WORK_DIR), sorted(os.listdir(folder)))

# %% [markdown]
# ## Predict on the executors

# %%
scored = ring_model.transform(test_df).select("text", "label", "label__output").toPandas()
logits = np.stack(scored["label__output"])
scored["predicted"] = logits.argmax(axis=1)
accuracy = float((scored["predicted"] == scored["label"]).mean())
print(f"held-out accuracy: {accuracy:.3f}")
print(scored.head(8).to_string(index=False))
assert accuracy > 0.8

# %% [markdown]
# ## Save and load: Hugging Face's own format inside the model folder

# %%
from estimators import RingModel

model_path = os.path.join(WORK_DIR, "review_model")
ring_model.write().overwrite().save(model_path)
print(sorted(os.listdir(os.path.join(WORK_DIR, "review_model", "model", "hf"))))

loaded = RingModel.load(model_path)
again = loaded.transform(test_df).select("label__output").toPandas()
same = np.allclose(np.stack(again["label__output"]), logits)
print(f"{type(loaded.getModel()).__name__} loaded; same outputs: {same}")
assert same

# %%
if OWN_SPARK:  # never stop the session Databricks gave the notebook
    spark.stop()
