"""torch ``nn.Module`` models: the torch framework (``_framework``) and its loop."""

from ._framework import TorchFramework, is_torch_module

__all__ = ["TorchFramework", "is_torch_module"]
