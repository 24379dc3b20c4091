"""A stand-in for the few parts of torchvision Horovod's examples call (tools/examples.py
puts it on their ``PYTHONPATH``; torchvision is not installed here and there is no
internet to download MNIST or pretrained models): ``datasets.MNIST`` reads the small
generated file named by ``RINGTRAIN_EXAMPLES_MNIST``, ``transforms`` has ``Compose``,
``ToTensor`` and ``Normalize``, and ``models.resnet50()`` is a small network with the
same call shape (images ``(N, 3, H, W)`` in, 1000 logits out); any other name of
``models`` is a placeholder that fails when called (Lightning imports torchmetrics,
which imports a few models when it finds a torchvision)."""

from . import datasets, models, transforms

__all__ = ["datasets", "models", "transforms"]
__version__ = "0.0+ringtrain.standin"
