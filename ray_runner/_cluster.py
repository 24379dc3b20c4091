"""What the driver asks of the Ray cluster before any worker starts, and which GPUs a
node's ranks see.

Every check raises before a placement group or an actor exists: Ray must be running in
this process, ``use_gpu=True`` needs a cluster with GPUs, and a Ray Client driver needs
a run folder that the cluster sees too (it reads the checkpoints the workers write).
"""

from __future__ import annotations

import contextlib
import os
import uuid

import ray

from ringcore import RingError
from ringcore.launch import GpuUnavailableError

__all__ = [
    "check_cluster_gpus",
    "check_visible_on_cluster",
    "client_connected",
    "cuda_visible_devices",
    "require_ray",
]


def require_ray(then: str) -> None:
    """Raise unless Ray runs in this process; ``then`` is what to call once it does."""
    if not ray.is_initialized():
        raise RingError(
            "Ray is not initialized in this process. Call ray.init() for a local instance "
            f"or ray.init(address='auto') to join a running cluster, then {then} again."
        )


def check_cluster_gpus(gpus_per_worker: float | None, where: str) -> None:
    """``use_gpu=True`` on a Ray cluster that has no GPU at all fails at once, instead of
    waiting out the placement timeout."""
    if not gpus_per_worker:
        return
    total = ray.cluster_resources()
    if total.get("GPU", 0) <= 0:
        raise GpuUnavailableError(
            f"{where}: use_gpu=True but the Ray cluster has no GPUs (its resources: "
            f"CPU={total.get('CPU', 0):g}, GPU=0). Start Ray on GPU nodes (ray start "
            "--num-gpus=N, or ray.init(num_gpus=N) for a local instance), or pass use_gpu=False."
        )


def cuda_visible_devices(node_ids: list[str], gpu_ids: list[list]) -> list[str]:
    """Per rank: the sorted GPU ids Ray assigned to all ranks of that rank's node."""
    per_node: dict[str, set[str]] = {}
    for node, ids in zip(node_ids, gpu_ids, strict=True):
        per_node.setdefault(node, set()).update(str(i) for i in ids)

    def key(gpu: str) -> tuple[int, str]:
        return (int(gpu), gpu) if gpu.isdigit() else (1 << 30, gpu)

    return [",".join(sorted(per_node[node], key=key)) for node in node_ids]


def client_connected() -> bool:
    """Whether this process is a Ray Client driver (``ray.init("ray://...")``)."""
    from ray.util.client import ray as client_ray

    return bool(client_ray.is_connected())


def _sees_marker(path: str) -> bool:
    return os.path.isfile(path)


def check_visible_on_cluster(run_dir: str) -> None:
    """Raise unless a Ray task on the cluster sees a file the driver wrote into ``run_dir``.

    Under Ray Client the driver reads the checkpoints that rank 0 writes, so the run
    folder must be one shared folder (NFS, a mounted bucket) and not the driver's own disk.
    """
    marker = os.path.join(run_dir, f".driver_{uuid.uuid4().hex}")
    with open(marker, "w"):
        pass
    try:
        task = ray.remote(num_cpus=0)(_sees_marker)
        seen = ray.get(task.remote(marker))
    finally:
        with contextlib.suppress(OSError):
            os.remove(marker)
    if not seen:
        raise RingError(
            f"the run folder {run_dir!r} that this Ray Client driver made is not visible on "
            "the cluster; the driver reads the checkpoints the workers write there. Pass "
            "RunConfig(storage_path=...) (or set $RING_STORAGE_PATH) to a folder that the "
            "driver and every cluster node share, e.g. an NFS mount"
        )
