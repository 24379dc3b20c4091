"""A Hugging Face fit's config: the torch loop's, plus the tokenizer; checked on the driver.

:data:`HF_PARAMS` are the params only a Hugging Face model reads (``tokenizer``,
``max_length``): set for another model they are refused before any job. :func:`hf_config`
resolves the torch loop's params (``torch_config``) and checks what only a
``PreTrainedModel`` needs: every feature column but the text one names a parameter of
``forward`` (read from its signature here), ``loss=None`` (the model's own loss) takes
one label column and no per-row weights, a text column has a ``max_length`` to pad to.
Each error names the value and the fix.
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..torch._config import TORCH_PARAMS, TorchConfig, torch_config
from ._peft import base_of

__all__ = ["HF_PARAMS", "HfConfig", "forward_params", "hf_config"]

HF_PARAMS: Mapping[str, Any] = {"tokenizer": None, "max_length": None}
_LONGEST = 100_000  # a tokenizer's model_max_length above this is "no limit" (transformers' 1e30)


@dataclass(frozen=True)
class HfConfig(TorchConfig):
    """The torch loop's params, plus how the model is called (``_call.HfCall``)."""

    tokenizer: Any = None
    max_length: int | None = None
    own_loss: bool = False  # loss=None: the model's outputs.loss


def forward_params(model: Any) -> list[str]:
    """The named parameters of ``model.forward`` (not ``*args`` / ``**kwargs``); a
    PeftModel's are its base model's, which it passes its keywords to."""
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    signature = inspect.signature(base_of(model).forward)
    return [n for n, p in signature.parameters.items() if p.kind not in kinds]


def check_own_loss(model: Any) -> None:
    """``loss=None`` needs a ``forward`` that takes ``labels`` (a model with a head)."""
    if "labels" not in forward_params(model):
        raise ValueError(
            f"loss is not set (loss=None), so the model's own loss is trained on, but "
            f"{type(base_of(model)).__name__}.forward takes no labels= (a base model without a head "
            "computes no loss). Use a model with a head (e.g. BertForSequenceClassification), "
            "or set a loss with setLoss(...)."
        )


def _check_features(cfg: Any) -> None:
    accepted = forward_params(cfg.model)
    unknown = [c for c in cfg.feature_cols if c not in cfg.text_cols and c not in accepted]
    if unknown:
        raise ValueError(
            f"feature column(s) {unknown} are passed to {type(base_of(cfg.model)).__name__}.forward by "
            f"name, but forward takes {', '.join(a for a in accepted if a != 'labels')}. Rename "
            "the columns to forward's parameters (df.withColumnRenamed) and set feature_cols "
            "to them (setFeatureCols)."
        )
    if len(cfg.text_cols) > 1:
        raise ValueError(
            f"feature_cols hold {len(cfg.text_cols)} text columns ({cfg.text_cols}); the "
            "tokenizer makes the model's inputs from one. Join them into one column "
            "(F.concat_ws(' ', ...)) first."
        )


def _check_own_loss(config: TorchConfig, cfg: Any) -> None:
    if len(cfg.label_cols) != 1:
        raise ValueError(
            f"loss=None passes the label column to the model as labels=, but label_cols names "
            f"{len(cfg.label_cols)} ({cfg.label_cols}); name one, or set a loss with setLoss(...)."
        )
    for name, value, unset in (
        ("sample_weight_col", cfg.sample_weight_col, None),
        ("loss_weights", config.loss_weights, None),
    ):
        if value != unset:
            raise ValueError(
                f"{name}={value!r} weighs the loss of the loss param, but loss=None trains on "
                f"the model's own loss; set a loss (setLoss(...)) or unset {name}."
            )


def _max_length(tokenizer: Any, max_length: int | None) -> int | None:
    if tokenizer is None:
        return max_length
    if max_length is not None:
        if max_length < 1:
            raise ValueError(f"max_length must be a positive number of tokens, got {max_length}.")
        return max_length
    limit = getattr(tokenizer, "model_max_length", None)
    if not isinstance(limit, int) or limit > _LONGEST:
        raise ValueError(
            f"tokenizer={type(tokenizer).__name__} has no model_max_length ({limit!r}) to pad "
            "and truncate the texts to; set max_length=, e.g. setMaxLength(128)."
        )
    return limit


def hf_config(params: Mapping[str, Any], cfg: Any) -> HfConfig:
    """The fit's :class:`HfConfig`, checked (see the module docstring)."""
    torch_part = torch_config(params, cfg)
    own_loss = cfg.loss is None and not torch_part.loss_constructors
    _check_features(cfg)
    if own_loss:
        _check_own_loss(torch_part, cfg)
    if torch_part.train_minibatch_fn is not None:
        raise ValueError(
            "train_minibatch_fn calls the model with positional inputs, but a Hugging Face "
            "model is called by name; unset train_minibatch_fn."
        )
    tokenizer = params["tokenizer"]
    if params["max_length"] is not None and tokenizer is None:
        raise ValueError(
            f"max_length={params['max_length']} is set but tokenizer is not; max_length "
            "pads the texts a tokenizer makes. Set tokenizer= or unset max_length."
        )
    return HfConfig(
        **{f.name: getattr(torch_part, f.name) for f in fields(TorchConfig)},
        tokenizer=tokenizer,
        max_length=_max_length(tokenizer, params["max_length"]),
        own_loss=own_loss,
    )


#: the params a Hugging Face model reads: the torch loop's and its own
ALL_PARAMS: Mapping[str, Any] = {**TORCH_PARAMS, **HF_PARAMS}
