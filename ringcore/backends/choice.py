"""Which library moves CUDA tensors: NCCL, or Gloo/MPI with CUDA staged through the host.

:func:`choose_backend` decides from ``RING_BACKEND`` and what this process has (CUDA,
NCCL, an ``mpirun`` launch, GPUs shared by ranks of one host): ``nccl`` (a
``cpu:gloo,cuda:nccl`` process group: CPU tensors through Gloo, CUDA tensors through
NCCL), ``gloo`` or ``mpi``. Under ``gloo`` and ``mpi`` a CUDA tensor is *copied to
host memory*, reduced there, and copied back (:class:`ringcore.backends.host_staged.HostStaged`)
— correct everywhere, but two PCIe copies per (fused) op. :func:`plan` gathers the
facts for ``init()``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from .. import _config as cfg
from .._errors import GpuUnavailableError
from .devices import cuda_available, pin_gpu

log = logging.getLogger("ringtrain.ringcore.gpu")

__all__ = ["BACKENDS", "BackendChoice", "choose_backend", "plan"]

BACKENDS = ("gloo", "nccl", "mpi")


@dataclass(frozen=True)
class BackendChoice:
    """The data plane of a job.

    ``name``: what ``backend_name()`` reports; ``process_group``: the
    ``torch.distributed`` backend string (None under MPI); ``cuda_through_host``:
    CUDA tensors are copied to host memory around each collective; ``reason``: why,
    in words (logged at start-up).
    """

    name: str
    process_group: str | None
    cuda_through_host: bool
    reason: str


def choose_backend(
    requested: str | None,
    *,
    cuda_available: bool,
    nccl_available: bool,
    mpi_launched: bool = False,
    shared_gpu: bool = False,
) -> BackendChoice:
    """The data plane for ``RING_BACKEND=requested`` (None or "" = choose).

    Without a request: ``mpi`` under mpirun; else ``nccl`` when CUDA and NCCL are
    both present and no two ranks of a host share one GPU (NCCL refuses that);
    else ``gloo``, with CUDA tensors (if any) staged through host memory.
    """
    want = (requested or "").strip().lower() or None
    if want is not None and want not in BACKENDS:
        raise ValueError(
            f"{cfg.BACKEND_ENV_VAR}={requested!r} is not a backend; use one of "
            f"{', '.join(BACKENDS)}, or unset it to choose automatically."
        )
    staged = cuda_available  # where CUDA tensors exist but the backend is CPU-only
    if want == "mpi" or (want is None and mpi_launched):
        return BackendChoice("mpi", None, staged, "launched by mpirun")
    if want == "nccl":
        missing = _nccl_missing(cuda_available, nccl_available, shared_gpu)
        if missing:
            raise GpuUnavailableError(
                f"{cfg.BACKEND_ENV_VAR}=nccl but {missing}. Unset {cfg.BACKEND_ENV_VAR} (CUDA "
                f"tensors then go through Gloo via host memory) or set {cfg.BACKEND_ENV_VAR}=gloo."
            )
        return BackendChoice("nccl", "cpu:gloo,cuda:nccl", False, f"{cfg.BACKEND_ENV_VAR}=nccl")
    if want is None and not _nccl_missing(cuda_available, nccl_available, shared_gpu):
        return BackendChoice("nccl", "cpu:gloo,cuda:nccl", False, "CUDA and NCCL are present")
    if want == "gloo":
        reason = f"{cfg.BACKEND_ENV_VAR}=gloo"
    elif not cuda_available:
        reason = "no CUDA device"
    elif not nccl_available:
        reason = "CUDA without NCCL (torch.distributed.is_nccl_available() is False)"
    else:
        reason = "ranks of one host share a GPU, which NCCL refuses"
    if staged:
        reason += "; CUDA tensors are copied to host memory for each collective"
    return BackendChoice("gloo", "gloo", staged, reason)


def _nccl_missing(cuda_available: bool, nccl_available: bool, shared_gpu: bool) -> str:
    if not cuda_available:
        return "torch.cuda.is_available() is False in this process"
    if not nccl_available:
        return "this torch has no NCCL (torch.distributed.is_nccl_available() is False)"
    if shared_gpu:
        return "two ranks of this host share one GPU, which NCCL refuses"
    return ""


def plan(topology: Any, store: Any, requested: str | None) -> BackendChoice:
    """The backend for ``init()``: ``requested`` (``RING_BACKEND``; None: choose), probes
    CUDA/NCCL, and when NCCL is a candidate pins this rank's GPU and asks the store
    whether a local peer pinned the same one (device UUIDs)."""
    import torch.distributed as dist

    has_cuda = cuda_available()
    has_nccl = bool(dist.is_nccl_available())
    shared = False
    if has_cuda and has_nccl and (requested or "").lower() in ("", "nccl"):
        pin_gpu(topology.local_rank, topology.local_size)
        shared = _shares_gpu(topology, store)
    choice = choose_backend(
        requested, cuda_available=has_cuda, nccl_available=has_nccl, shared_gpu=shared
    )
    log.debug("data plane %s (%s)", choice.name, choice.reason)
    return choice


def _shares_gpu(topology: Any, store: Any) -> bool:
    """True when another rank of this host pinned the same GPU (compared by UUID)."""
    import socket

    import torch

    if topology.local_size == 1:
        return False
    mine = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    host = socket.gethostname()
    store.set(f"gpu/{topology.rank}", f"{host}|{mine}")
    hosts = topology.hosts
    peers = [
        r
        for r in range(topology.size)
        if r != topology.rank and (not hosts or hosts[r] == hosts[topology.rank])
    ]
    seen = {store.get(f"gpu/{r}").decode() for r in peers}
    return f"{host}|{mine}" in seen
