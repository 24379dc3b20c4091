"""``MNIST`` on the generated stand-in file (see the package docstring)."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

MNIST_ENV_VAR = "RINGTRAIN_EXAMPLES_MNIST"


class MNIST(torch.utils.data.Dataset):
    """torchvision's call shape; ``root`` and ``download`` are accepted and not used."""

    def __init__(
        self,
        root: str,
        train: bool = True,
        transform: Callable[[Any], Any] | None = None,
        target_transform: Callable[[Any], Any] | None = None,
        download: bool = False,
    ):
        part = "train" if train else "test"
        with np.load(os.environ[MNIST_ENV_VAR]) as arrays:
            self.data = arrays[f"x_{part}"]
            self.targets = torch.as_tensor(arrays[f"y_{part}"], dtype=torch.int64)
        self.transform, self.target_transform = transform, target_transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        image: Any = self.data[index]
        target: Any = int(self.targets[index])
        if self.transform is not None:
            image = self.transform(image)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return image, target
