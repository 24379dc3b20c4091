"""GPUs: which library moves CUDA tensors, which device a rank owns, and CUDA streams.

Three decisions, each a small function so that they can be tested without a GPU:

- :func:`choose_backend` — from ``RING_BACKEND`` and what this process has (CUDA,
  NCCL, an ``mpirun`` launch, GPUs shared by ranks of one host), the data plane:
  ``nccl`` (a ``cpu:gloo,cuda:nccl`` process group: CPU tensors through Gloo, CUDA
  tensors through NCCL), ``gloo`` or ``mpi``. Under ``gloo`` and ``mpi`` a CUDA
  tensor is *copied to host memory*, reduced there, and copied back
  (:class:`ringcore._backends.HostStaged`) — correct everywhere, but two PCIe copies
  per (fused) op.
- :func:`device_index` / :func:`pin_gpu` — the CUDA device of a rank:
  ``torch.cuda.set_device`` on the GPU the runner assigned (Spark's task resources
  and Ray's actors arrive as ``CUDA_VISIBLE_DEVICES``), else ``local_rank``.
- Streams (used by the engine): a CUDA op records an event on the submitting thread's
  stream; the engine thread runs the op (fusion copies, scaling, the collective) on
  one side stream per device that first waits for that event, so backward keeps
  computing on its own stream while gradients travel; ``synchronize()`` makes the
  caller's stream wait for the side stream (a GPU-side wait, not a host block).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from . import _config as cfg
from ._errors import RingError

log = logging.getLogger("ringtrain.ringcore.gpu")

__all__ = [
    "BackendChoice",
    "GpuUnavailableError",
    "check_use_gpu",
    "choose_backend",
    "device_index",
    "pin_gpu",
]

VISIBLE_DEVICES_ENV_VAR = "CUDA_VISIBLE_DEVICES"
BACKENDS = ("gloo", "nccl", "mpi")


class GpuUnavailableError(RingError):
    """GPU work was asked for where this process has no usable CUDA device."""


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


def pin_gpu(local_rank: int | None = None, local_size: int | None = None) -> Any:
    """``torch.cuda.set_device`` on this rank's GPU; returns the ``torch.device``.

    ``local_rank``/``local_size`` default to ringcore's topology (after ``init()``)
    or ``RING_LOCAL_RANK``/``RING_LOCAL_SIZE``. Raises :class:`GpuUnavailableError`
    without CUDA.
    """
    import torch

    check_use_gpu(True, "pin_gpu")
    if local_rank is None or local_size is None:
        lr, ls = _local_position()
        local_rank = lr if local_rank is None else local_rank
        local_size = ls if local_size is None else local_size
    index = device_index(
        local_rank,
        local_size,
        torch.cuda.device_count(),
        bool(os.environ.get(VISIBLE_DEVICES_ENV_VAR)),
    )
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def _local_position() -> tuple[int, int]:
    from ._runtime import _state

    if _state is not None:
        return _state.topology.local_rank, _state.topology.local_size
    return (
        cfg.get_int(cfg.LOCAL_RANK_ENV_VAR, 0),
        cfg.get_int(cfg.LOCAL_SIZE_ENV_VAR, 1),
    )


def plan(topology: Any, store: Any) -> BackendChoice:
    """The backend for ``init()``: reads ``RING_BACKEND``, probes CUDA/NCCL, and when
    NCCL is a candidate pins this rank's GPU and asks the store whether a local peer
    pinned the same one (device UUIDs)."""
    import torch.distributed as dist

    requested = cfg.get_env(cfg.BACKEND_ENV_VAR)
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


def device_of_type(dev: str | None) -> Any:
    """The device a joined rank makes its neutral contribution on: this rank's current
    CUDA device for ``"cuda"`` requests (NCCL must see CUDA memory), else the CPU."""
    if dev == "cuda" and cuda_available():
        import torch

        return torch.device("cuda", torch.cuda.current_device())
    return "cpu"


# -- streams --------------------------------------------------------------------------

_streams: dict[int, Any] = {}
_streams_lock = threading.Lock()


def side_stream(device: Any) -> Any:
    """The engine's CUDA stream on ``device`` (one per device, made on first use)."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _streams_lock:
        stream = _streams.get(index)
        if stream is None:
            stream = _streams[index] = torch.cuda.Stream(device=index)
    return stream


def mark_ready(handle: Any) -> None:
    """At submission: an event on the submitting stream, after which the tensor is ready."""
    t = handle.tensor
    if t is not None and t.is_cuda:
        import torch

        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        handle.event = event


@contextlib.contextmanager
def device_scope(handles: list[Any]) -> Iterator[None]:
    """Run the engine's work for ``handles`` on the side stream, after their events."""
    events = [h.event for h in handles if h is not None and h.event is not None]
    if not events:
        yield
        return
    import torch

    device = next(h.tensor.device for h in handles if h is not None and h.event is not None)
    stream = side_stream(device)
    for event in events:
        stream.wait_event(event)
    with torch.cuda.stream(stream):
        yield


def join_streams(handle: Any) -> None:
    """After a wait: the caller's stream waits for the side stream, so reading the
    result on it is ordered after the collective (no host-side block), and results
    made on the side stream are marked as used by the caller's stream (so the caching
    allocator does not hand their memory to the side stream too early)."""
    parts = getattr(handle, "parts", None) or [handle]
    if all(getattr(p, "event", None) is None for p in parts):
        return
    import torch

    device = next(p.tensor.device for p in parts if getattr(p, "event", None) is not None)
    current = torch.cuda.current_stream(device)
    current.wait_stream(side_stream(device))
    for part in parts:
        for t in _tensors(part.result):
            if t.is_cuda:
                t.record_stream(current)


def _tensors(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, list | tuple):
        return [t for v in value for t in _tensors(v)]
    return []
