"""RingEstimator(model=<a peft PeftModel>): only the adapters train, and only they are saved.

A tiny BERT (built from a config, saved to a folder and loaded back from it, as a
pretrained base would be) gets LoRA adapters (r=4) on its attention's query and value
and learns whether token 5 appears, on two workers under fsdp (sharded, its checkpoints
sharded; ring and ddp train it as any model, test_estimator_hf's path); its base weights
stay as they were, the saved model is PEFT's adapter files plus the base's config, and
the reloaded model predicts the same. Bad input is refused naming the fix.
On the suite's shared ``local[2]`` session.
"""

from __future__ import annotations

import os

import _spark
import numpy as np
import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("transformers")
from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from test_estimator_hf import _accuracy, _bert, _estimator, _token_rows  # noqa: E402
from transformers import BertForSequenceClassification  # noqa: E402

from estimators import RingModel, Store  # noqa: E402

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)
# peft asks transformers' deprecated is_gradient_checkpointing (transformers 5.25, peft 0.21.2)
pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"
)
SCHEMA = "input_ids array<int>, attention_mask array<int>, label int"


@pytest.fixture(scope="module")
def spark():
    return _spark.shared_session()  # never stopped here: see tests/_spark.py


@pytest.fixture(scope="module")
def base_folder(tmp_path_factory) -> str:
    """A tiny BERT's save_pretrained folder: the base's weights, as a hub model's are."""
    folder = str(tmp_path_factory.mktemp("base"))
    _bert().save_pretrained(folder)
    return folder


def _lora(base_folder: str) -> PeftModel:
    base = BertForSequenceClassification.from_pretrained(base_folder)
    config = LoraConfig(task_type="SEQ_CLS", r=4, target_modules=["query", "value"])
    return get_peft_model(base, config)  # the classifier head trains too (modules_to_save)


def _is_adapter(name: str) -> bool:
    return "lora_" in name or "modules_to_save" in name


@pytest.mark.spark
def test_a_lora_bert_trains_only_its_adapters_and_reloads_from_peft_adapter_files(
    spark, tmp_path, base_folder
):
    train = spark.createDataFrame(_token_rows(0, rows=256), SCHEMA)
    test = spark.createDataFrame(_token_rows(1, rows=64), SCHEMA)
    model = _lora(base_folder)
    estimator = _estimator(
        Store.create(str(tmp_path / "store")), model=model, strategy="fsdp",
        optimizer=torch.optim.Adam(model.parameters(), lr=1e-2),
    )  # fmt: skip
    fitted = estimator.fit(train)
    losses = [h["train_loss"] for h in fitted.getHistory()]
    assert losses[-1] < losses[0], losses

    trained, pretrained = (
        fitted.getModel(),
        BertForSequenceClassification.from_pretrained(base_folder),
    )
    assert type(trained) is type(model)
    original = pretrained.state_dict()
    for name, param in trained.get_base_model().named_parameters():
        if _is_adapter(name):
            assert param.requires_grad, name
            continue
        assert not param.requires_grad, name  # the base stays frozen ...
        key = name.replace(".base_layer", "").replace(".original_module", "")
        assert torch.equal(param, original[key]), name  # ... and as it was
    assert all(p.abs().sum() > 0 for n, p in trained.named_parameters() if "lora_B" in n)

    _, logits = _accuracy(fitted, test)
    path = str(tmp_path / "saved")
    fitted.save(path)
    folder = os.path.join(path, "model", "hf")
    assert {"adapter_config.json", "adapter_model.safetensors", "config.json"} <= set(
        os.listdir(folder)
    )
    assert not os.path.exists(os.path.join(folder, "model.safetensors"))  # no base weights
    with safe_open(os.path.join(folder, "adapter_model.safetensors"), "pt") as saved:
        names = list(saved.keys())
    assert names and all("lora_" in n or "classifier" in n for n in names), names
    loaded = RingModel.load(path)
    assert type(loaded.getModel()) is type(model)
    np.testing.assert_array_equal(_accuracy(loaded, test)[1], logits)


@pytest.mark.spark
def test_saving_adapters_whose_base_names_no_weights_is_refused_naming_the_fix(spark, tmp_path):
    model = get_peft_model(_bert(), LoraConfig(task_type="SEQ_CLS", r=4))  # from a config
    with pytest.raises(ValueError) as info:
        RingModel(model=model).save(str(tmp_path / "saved"))
    for needle in ("not loaded with from_pretrained", "base.save_pretrained(folder)",
                   "base_model_name_or_path"):  # fmt: skip
        assert needle in str(info.value), str(info.value)
    assert not (tmp_path / "saved").exists()  # refused before anything was written


@pytest.mark.spark
def test_a_peft_model_with_nothing_to_train_is_refused_before_any_job(spark, tmp_path, base_folder):
    adapters = str(tmp_path / "adapters")
    _lora(base_folder).save_pretrained(adapters)
    frozen = PeftModel.from_pretrained(
        BertForSequenceClassification.from_pretrained(base_folder), adapters
    )  # inference mode: every adapter frozen
    df = spark.createDataFrame(_token_rows(4, rows=32), SCHEMA)
    estimator = _estimator(Store.create(str(tmp_path / "store")), model=frozen)
    message = _spark.fit_refused_before_any_job(spark, estimator, df)
    for needle in ("no trainable parameters", "is_trainable=True", "get_peft_model"):
        assert needle in message, message
