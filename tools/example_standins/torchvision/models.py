"""``resnet50()``: a small network of the same call shape (see the package docstring)."""

from __future__ import annotations

from typing import Any

from torch import nn


def resnet50(**kwargs: Any) -> nn.Module:
    """Images ``(N, 3, H, W)`` -> 1000 logits, with a convolution, a batch norm and a
    linear layer (about 10,000 parameters instead of ResNet-50's 25 million)."""
    return nn.Sequential(
        nn.Conv2d(3, 8, kernel_size=7, stride=4, padding=3),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 1000),
    )


def __getattr__(name: str) -> Any:
    """Any other name of torchvision.models: a placeholder that fails when used.
    torchmetrics (imported by Lightning) imports ``VGG16_Weights`` and ``vgg16`` when it
    finds a torchvision, without using them unless asked to."""
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args: Any, **kwargs: Any) -> Any:
        raise NotImplementedError(f"torchvision.models.{name} is not in the stand-in")

    return missing
