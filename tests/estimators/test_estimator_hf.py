"""RingEstimator(model=<a transformers PreTrainedModel>): inputs by name, its own loss.

A tiny BERT (built from a config: nothing downloaded) learns whether token 5 appears in
a sequence, from integer array columns under strategy='fsdp' on two workers, and its
saved model (Hugging Face's own format) predicts the same; a text column is tokenized
on the workers and in transform with tokenizer=, and saved in Hugging Face's format too;
the bad input is refused before any job.
On the suite's shared ``local[2]`` session.
"""

from __future__ import annotations

import os

import _spark
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    BertConfig,
    BertForSequenceClassification,
    BertModel,
    PreTrainedTokenizerFast,
)

from estimators import RingEstimator, RingModel, Store  # noqa: E402

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)
LENGTH, ROWS, WORDS = 8, 512, ("six", "seven", "eight", "nine", "ten", "eleven")


@pytest.fixture(scope="module")
def spark():
    import _spark

    return _spark.shared_session()  # never stopped here: see tests/_spark.py


def _bert(num_labels: int = 2, head: bool = True) -> torch.nn.Module:
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=16, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=16, num_labels=num_labels,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )  # fmt: skip
    return BertForSequenceClassification(config) if head else BertModel(config)


def _token_rows(seed: int, rows: int = ROWS) -> list[tuple[list[int], list[int], int]]:
    """Sequences of tokens 6..11; label 1 where token 5 replaces one of them."""
    rng = np.random.default_rng(seed)
    ids, labels = rng.integers(6, 12, size=(rows, LENGTH)), rng.integers(0, 2, size=rows)
    ids[labels == 1, rng.integers(0, LENGTH, size=int(labels.sum()))] = 5
    return [(row.tolist(), [1] * LENGTH, int(y)) for row, y in zip(ids, labels, strict=True)]


def _estimator(store, model=None, **params) -> RingEstimator:
    model = model if model is not None else _bert()
    defaults = dict(
        model=model, optimizer=torch.optim.Adam(model.parameters(), lr=3e-3), loss=None,
        feature_cols=["input_ids", "attention_mask"], label_cols=["label"], num_proc=2,
        batch_size=16, epochs=2, store=store, random_seed=1, verbose=0, progress=False,
        reader="arrow",
    )  # fmt: skip
    defaults.update(params)
    return RingEstimator(**defaults)


def _accuracy(model: RingModel, df) -> tuple[float, np.ndarray]:
    rows = model.transform(df).select("label", "label__output").collect()
    logits = np.array([r["label__output"] for r in rows])
    labels = np.array([r["label"] for r in rows])
    return float((logits.argmax(axis=1) == labels).mean()), logits


@pytest.mark.spark
def test_a_tiny_bert_under_fsdp_learns_a_token_rule_and_reloads_from_its_hf_folder(spark, tmp_path):
    schema = "input_ids array<int>, attention_mask array<int>, label int"
    train = spark.createDataFrame(_token_rows(0), schema)
    test = spark.createDataFrame(_token_rows(1, rows=128), schema)
    fitted = _estimator(Store.create(str(tmp_path / "store")), strategy="fsdp").fit(train)
    assert len(fitted.getHistory()) == 2
    accuracy, logits = _accuracy(fitted, test)
    assert accuracy >= 0.9, fitted.getHistory()

    path = str(tmp_path / "saved")
    fitted.save(path)
    assert os.path.exists(os.path.join(path, "model", "hf", "config.json"))
    assert not os.path.exists(os.path.join(path, "model", "module.pkl"))  # no pickle
    loaded = RingModel.load(path)
    assert type(loaded.getModel()) is BertForSequenceClassification
    np.testing.assert_array_equal(_accuracy(loaded, test)[1], logits)


def _tokenizer(tmp_path) -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    vocab = {"[PAD]": 0, "[UNK]": 1, "five": 5, **{w: 6 + i for i, w in enumerate(WORDS)}}
    words = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    words.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, pad_token="[PAD]", unk_token="[UNK]")


def _text_rows(seed: int, rows: int) -> list[tuple[str, int]]:
    """Texts of up to 6 words (padded to 8 tokens); label 1 where "five" is one of them."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(rows):
        words = [WORDS[i] for i in rng.integers(0, len(WORDS), size=rng.integers(3, 7))]
        label = int(rng.integers(0, 2))
        if label:
            words[rng.integers(0, len(words))] = "five"
        out.append((" ".join(words), label))
    return out


@pytest.mark.spark
def test_a_text_column_is_tokenized_on_the_workers_and_in_transform_under_ddp(spark, tmp_path):
    train = spark.createDataFrame(_text_rows(2, ROWS), "text string, label int")
    test = spark.createDataFrame(_text_rows(3, 128), "text string, label int")
    tokenizer = _tokenizer(tmp_path)
    estimator = _estimator(
        Store.create(str(tmp_path / "store")), strategy="ddp", feature_cols=["text"],
        tokenizer=tokenizer, max_length=LENGTH,
    )  # fmt: skip
    fitted = estimator.fit(train)
    assert fitted.getMaxLength() == LENGTH and fitted.getTokenizer() is not None
    accuracy, logits = _accuracy(fitted, test)
    assert accuracy >= 0.9, fitted.getHistory()

    path = str(tmp_path / "saved")
    fitted.save(path)
    assert os.path.exists(os.path.join(path, "model", "tokenizer", "tokenizer.json"))
    assert not os.path.exists(os.path.join(path, "model", "params.pkl"))  # no pickle of it
    loaded = RingModel.load(path)
    assert loaded.getMaxLength() == LENGTH
    assert type(loaded.getTokenizer()) is type(tokenizer)
    texts = [text for text, _ in _text_rows(3, 16)]
    assert loaded.getTokenizer()(texts)["input_ids"] == tokenizer(texts)["input_ids"]
    np.testing.assert_array_equal(_accuracy(loaded, test)[1], logits)


# --- bad input: refused before any job --------------------------------------------------


class _Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(LENGTH, 2)

    def forward(self, x):
        return self.linear(x)


BAD = {
    "loss-None-with-a-base-model": (
        {"model": _bert(head=False)},
        ("loss=None", "BertModel.forward takes no labels=", "setLoss("),
    ),
    "loss-None-with-a-torch-module": (
        {"model": _Linear()},
        ("loss=None", "_Linear computes no loss", "setLoss("),
    ),
    "a-feature-column-forward-does-not-take": (
        {"feature_cols": ["input_ids", "mask"]},
        ("['mask']", "forward takes input_ids, attention_mask", "withColumnRenamed"),
    ),
    "tokenizer-without-a-text-column": (
        {"tokenizer": "the test's tokenizer"},
        ("is set but no feature column holds text", "unset tokenizer"),
    ),
    "a-text-column-without-tokenizer": (
        {"feature_cols": ["text"]},
        ("feature column 'text' has type string", "pass tokenizer="),
    ),
    "loss-None-with-sample-weights": (
        {"sample_weight_col": "weight"},
        ("sample_weight_col='weight'", "the model's own loss", "set a loss"),
    ),
    "max_length-without-tokenizer": (
        {"max_length": 8},
        ("max_length=8 is set but tokenizer is not", "Set tokenizer="),
    ),
}


@pytest.mark.spark
@pytest.mark.parametrize("case", list(BAD))
def test_bad_hf_input_is_refused_naming_value_and_fix_before_any_job(spark, tmp_path, case):
    params, needles = BAD[case]
    if "tokenizer" in params:
        params = {"tokenizer": _tokenizer(tmp_path)}
    df = spark.createDataFrame(
        [(r[0], r[1], r[1], "six five", r[2], 1.0) for r in _token_rows(4, rows=64)],
        "input_ids array<int>, attention_mask array<int>, mask array<int>, text string, "
        "label int, weight double",
    )
    estimator = _estimator(Store.create(str(tmp_path / "store")), **params)
    message = _spark.fit_refused_before_any_job(spark, estimator, df)
    for needle in needles:
        assert needle in message, f"{needle!r} not in: {message}"


@pytest.mark.spark
def test_transform_writes_the_named_output_and_refuses_it_for_another_framework(spark):
    schema = "input_ids array<int>, attention_mask array<int>, label int"
    rows = _token_rows(2, rows=8)
    df = spark.createDataFrame(rows, schema)
    base = _bert(head=False).eval()  # a BertModel: last_hidden_state and pooler_output
    columns = dict(feature_cols=["input_ids", "attention_mask"], label_cols=["label"])
    ring = RingModel(model=base, model_output="pooler_output", **columns)
    got = np.array([r["label__output"] for r in ring.transform(df).collect()])
    with torch.no_grad():
        want = base(
            input_ids=torch.tensor([r[0] for r in rows]),
            attention_mask=torch.tensor([r[1] for r in rows]),
        ).pooler_output.numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # the default, logits, from a model without a head: the error names the setter
    with pytest.raises(Exception, match=r"no 'logits'.*setModelOutput"):
        ring.setModelOutput(None).transform(df).collect()
    with pytest.raises(ValueError, match=r"model_output='pooler_output' is set, but only a hug"):
        RingModel(model=torch.nn.Linear(8, 2), model_output="pooler_output", **columns).transform(
            df
        )
