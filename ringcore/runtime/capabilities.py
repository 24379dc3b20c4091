"""Truthful answers about what this installation can do."""

from __future__ import annotations

import importlib.util

from .state import backend_name

__all__ = [
    "ccl_built",
    "cuda_built",
    "ddl_built",
    "gloo_built",
    "gloo_enabled",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "rocm_built",
]


def _torch_dist():
    try:
        import torch.distributed as dist
    except ImportError:
        return None
    return dist if dist.is_available() else None


def gloo_built() -> bool:
    dist = _torch_dist()
    return bool(dist and dist.is_gloo_available())


def gloo_enabled() -> bool:
    return gloo_built()


def nccl_built() -> bool:
    dist = _torch_dist()
    return bool(dist and dist.is_nccl_available())


def mpi_built() -> bool:
    return importlib.util.find_spec("mpi4py") is not None


def mpi_enabled() -> bool:
    """True when the running job moves its data through MPI (launched by mpirun)."""
    return backend_name() == "mpi"


def mpi_threads_supported() -> bool:
    import sys

    mpi = sys.modules.get("mpi4py.MPI")  # never initialize MPI just to answer
    return bool(
        mpi is not None and mpi.Is_initialized() and mpi.Query_thread() == mpi.THREAD_MULTIPLE
    )


def cuda_built() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.version.cuda is not None


def rocm_built() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return getattr(torch.version, "hip", None) is not None


def ccl_built() -> bool:
    return False


def ddl_built() -> bool:
    return False
