"""PEFT (LoRA, ...) models: a ``peft.PeftModel`` over a ``transformers.PreTrainedModel``.

A PeftModel trains in the torch loop as the model it wraps (the Hugging Face call, by
name): only its trainable parameters (the adapters, and ``modules_to_save`` such as a
classifier head) get gradients and an optimizer step; the base model's weights stay as
they were. peft is imported only once a model of it exists (the user imported it).
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["base_of", "check_peft", "is_peft_model"]


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (peft is not imported)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def base_of(model: Any) -> Any:
    """The ``transformers`` model a PeftModel wraps (``model`` itself for another)."""
    return model.get_base_model() if is_peft_model(model) else model


def check_peft(model: Any) -> None:
    """A PeftModel with nothing to train is refused, naming the fix."""
    if not is_peft_model(model):
        return
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(
            f"model is a {type(model).__name__} with no trainable parameters (every adapter "
            "is frozen: a PeftModel loaded for inference), so a fit would change nothing. "
            "Load it with PeftModel.from_pretrained(base, path, is_trainable=True), or build "
            "it with peft.get_peft_model(base, config)."
        )
