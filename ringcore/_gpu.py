"""GPUs, by their old address: the names of ``_backend_choice`` (which library moves
CUDA tensors), ``_device_pinning`` (which device a rank owns) and ``_cuda_streams``
(the engine's side streams), re-exported for code that imports them from here.
New code imports the module named for what it needs.
"""

from __future__ import annotations

from ._backend_choice import BACKENDS, BackendChoice, choose_backend, plan
from ._cuda_streams import device_scope, join_streams, mark_ready, side_stream
from ._device_pinning import (
    VISIBLE_DEVICES_ENV_VAR,
    GpuUnavailableError,
    check_use_gpu,
    cuda_available,
    device_index,
    device_of_type,
    pin_gpu,
)

__all__ = [
    "BACKENDS",
    "VISIBLE_DEVICES_ENV_VAR",
    "BackendChoice",
    "GpuUnavailableError",
    "check_use_gpu",
    "choose_backend",
    "cuda_available",
    "device_index",
    "device_of_type",
    "device_scope",
    "join_streams",
    "mark_ready",
    "pin_gpu",
    "plan",
    "side_stream",
]
