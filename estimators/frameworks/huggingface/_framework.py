"""Hugging Face models: the :class:`~estimators.frameworks.Framework` for ``"huggingface"``.

A ``transformers.PreTrainedModel`` is a torch ``nn.Module`` and trains in the torch
loop under every strategy (``ring``, ``ddp``, ``fsdp``: a BERT's layers, a ModuleList,
become FSDP units); what differs is how it is called, which this framework gives the
loop as its :class:`~._call.HfCall` (``TorchFramework.fit_call`` / ``predict_call``):
feature columns by name, integer columns as int64 (``typed_features``), a text column
tokenized with ``tokenizer=`` on the workers and in ``transform``, ``loss=None`` for the
model's own loss. A ``peft.PeftModel`` over such a model (``_peft``) trains the same
way, only its trainable parameters (the adapters) changing. Checked on the driver before
any job (``_config``); the model and the tokenizer saved with their ``save_pretrained``
(a PeftModel: its adapters alone; ``_model_io``). transformers and peft are imported only
once a model of them exists (the user imported it).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from .._base import Framework
from ..torch._calling import ModelCall
from ..torch._checks import check_torch_params
from ..torch._framework import TorchFramework
from ..torch._metrics import resolve_metrics
from ._call import HfCall
from ._config import ALL_PARAMS, HF_PARAMS, check_own_loss, forward_params, hf_config
from ._model_io import (
    check_saveable,
    load_pretrained,
    load_tokenizer,
    save_pretrained,
    save_tokenizer,
)
from ._peft import base_of, check_peft

__all__ = ["HuggingFaceFramework", "is_hf_model"]


def is_hf_model(model: Any) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel``, or a ``peft.PeftModel``
    over one (neither transformers nor peft is imported)."""
    transformers = sys.modules.get("transformers")
    if transformers is None:
        return False
    return isinstance(base_of(model), transformers.PreTrainedModel)


def _long_labels(model: Any) -> bool:
    """A classifier's own loss takes class indices: int64 labels (a Spark double too)."""
    config = getattr(base_of(model), "config", None)
    problem = getattr(config, "problem_type", None)
    return getattr(config, "num_labels", 1) > 1 and problem in (None, "single_label_classification")


class HuggingFaceFramework(TorchFramework):
    """Hugging Face ``PreTrainedModel``\\ s (see the module docstring)."""

    name = "huggingface"
    typed_features = True
    params: Mapping[str, Any] = ALL_PARAMS
    reads_model_params = frozenset({"tokenizer", "max_length", "model_output"})

    def refusal(self, name: str, value: Any, model: Framework) -> str:
        return Framework.refusal(self, name, value, model)

    def instead(self, name: str) -> str | None:
        return None if name in HF_PARAMS else super().instead(name)

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        check_peft(model)
        if loss is None:
            check_own_loss(model)
        check_torch_params(model, optimizer, loss, own_loss=loss is None)
        resolve_metrics(metrics)

    def resolve(self, params: Mapping[str, Any], cfg: Any) -> Any:
        return hf_config(params, cfg)

    def _call(self, model: Any, names: list[str], tokenizer: Any, max_length: Any) -> HfCall:
        return HfCall(
            names=tuple(names),
            accepted=frozenset(forward_params(model)),
            tokenizer=tokenizer,
            max_length=max_length,
            long_labels=_long_labels(model),
        )

    def fit_call(self, cfg: Any) -> ModelCall:
        config = cfg.framework_config
        call = self._call(cfg.model, cfg.feature_cols, config.tokenizer, config.max_length)
        return replace(call, own_loss=config.own_loss)

    def predict_call(self, model: Any, params: Mapping[str, Any]) -> ModelCall:
        call = self._call(
            model, params["feature_cols"], params.get("tokenizer"), params.get("max_length")
        )
        return replace(call, output=params.get("model_output") or call.output)

    def model_params(self, cfg: Any) -> dict[str, Any]:
        config = cfg.framework_config
        if config.tokenizer is None:
            return {}
        return {"tokenizer": config.tokenizer, "max_length": config.max_length}

    def check_save(self, model: Any) -> None:
        check_saveable(model)

    def save_model(self, model: Any, path: str) -> None:
        save_pretrained(model, path)

    def load_model(self, path: str) -> Any:
        return load_pretrained(path)

    def save_model_params(self, params: Mapping[str, Any], path: str) -> dict[str, Any]:
        rest = dict(params)
        if "tokenizer" in rest and save_tokenizer(rest["tokenizer"], path):
            del rest["tokenizer"]
        return rest

    def load_model_params(self, path: str) -> dict[str, Any]:
        tokenizer = load_tokenizer(path)
        return {} if tokenizer is None else {"tokenizer": tokenizer}
