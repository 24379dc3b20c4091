"""Keras 3 models: the Keras framework (``_framework``), on ``ringcore.keras``."""

from ._framework import KerasFramework, is_keras_model

__all__ = ["KerasFramework", "is_keras_model"]
