"""LightningModules: the Lightning framework (``_framework``), under a real Trainer."""

from ._framework import LightningFramework, is_lightning_module

__all__ = ["LightningFramework", "is_lightning_module"]
