"""Which CUDA device a rank owns, and checks that GPU work asked for is possible.

:func:`device_index` / :func:`pin_gpu`: ``torch.cuda.set_device`` on the GPU the
runner assigned (Spark's task resources and Ray's actors arrive as
``CUDA_VISIBLE_DEVICES``), else ``local_rank``. :func:`check_use_gpu` validates a
``use_gpu`` option for the launchers. Small functions, testable without a GPU;
torch is imported only when one runs. (``ringcore.launch.pin_gpu`` fills in this rank's
place on its host from the running job.)
"""

from __future__ import annotations

import os
from typing import Any

from .._errors import GpuUnavailableError

__all__ = [
    "VISIBLE_DEVICES_ENV_VAR",
    "check_use_gpu",
    "cuda_available",
    "device_index",
    "device_of_type",
    "pin_gpu",
]

VISIBLE_DEVICES_ENV_VAR = "CUDA_VISIBLE_DEVICES"


def device_index(local_rank: int, local_size: int, device_count: int, visible_set: bool) -> int:
    """The CUDA device index a rank pins.

    Every GPU of the host visible (``device_count >= local_size``): the local rank.
    Fewer devices than local ranks and ``CUDA_VISIBLE_DEVICES`` set (a runner gave
    this process its own GPUs): the first visible one. Otherwise ranks share GPUs
    round-robin (``local_rank % device_count``).
    """
    if device_count < 1:
        raise GpuUnavailableError("no CUDA device is visible to this process")
    if device_count >= local_size:
        return local_rank
    return 0 if visible_set else local_rank % device_count


def cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def check_use_gpu(use_gpu: Any, where: str) -> bool:
    """Validate a ``use_gpu`` option; True only when GPU work is asked for and possible.

    ``use_gpu=None`` means "a GPU if there is one". ``use_gpu=True`` without a CUDA
    device raises :class:`GpuUnavailableError` naming the option, the value and the fix.
    """
    if use_gpu is not None and not isinstance(use_gpu, bool):
        raise TypeError(f"{where}: use_gpu must be None, True or False, got {use_gpu!r}")
    if use_gpu is False:
        return False
    if cuda_available():
        return True
    if use_gpu:
        import torch

        cause = (
            "this torch is a CPU-only build (torch.version.cuda is None)"
            if torch.version.cuda is None
            else f"torch.cuda.is_available() is False ({VISIBLE_DEVICES_ENV_VAR}="
            f"{os.environ.get(VISIBLE_DEVICES_ENV_VAR)!r})"
        )
        raise GpuUnavailableError(
            f"{where}: use_gpu=True but {cause}. Install a CUDA build of torch and run where a "
            "GPU is visible, or pass use_gpu=False (or None: a GPU when there is one)."
        )
    return False


def pin_gpu(local_rank: int, local_size: int) -> Any:
    """``torch.cuda.set_device`` on the GPU of the rank at ``local_rank`` of the
    ``local_size`` ranks of its host; returns the ``torch.device``. Raises
    :class:`GpuUnavailableError` without CUDA."""
    import torch

    check_use_gpu(True, "pin_gpu")
    index = device_index(
        local_rank,
        local_size,
        torch.cuda.device_count(),
        bool(os.environ.get(VISIBLE_DEVICES_ENV_VAR)),
    )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def device_of_type(dev: str | None) -> Any:
    """The device a joined rank makes its neutral contribution on: this rank's current
    CUDA device for ``"cuda"`` requests (NCCL must see CUDA memory), else the CPU."""
    if dev == "cuda" and cuda_available():
        import torch

        return torch.device("cuda", torch.cuda.current_device())
    return "cpu"
