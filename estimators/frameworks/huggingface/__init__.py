"""Hugging Face ``transformers`` models: the ``huggingface`` framework (``_framework``)."""

from ._framework import HuggingFaceFramework, is_hf_model

__all__ = ["HuggingFaceFramework", "is_hf_model"]
