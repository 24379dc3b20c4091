"""One process group per job, whoever forms it first: the user's program or ``init()``.

A launcher gives every worker torchrun's variables (``torchrun_env``), so a
``torch.distributed`` program forms the job's group with
``init_process_group()``; ``ringcore.init()`` then adopts that group
(``torch_ring.connect``). When ``init()`` came first, ringcore formed the default group,
and the program's own ``init_process_group()`` would fail ("trying to initialize the
default process group twice"): the guard installed here turns that call into a use of
ringcore's group, after checking that it asks for nothing the group is not.

The guard also checks a program's explicit ``rank=`` / ``world_size=`` against the
launcher's (``RING_RANK`` / ``RING_SIZE``): a disagreement would otherwise wait at the
rendezvous until its timeout. Under a launcher it forms the program's own env:// group
as ringcore forms its ring: Gloo on the interface on the route to the job's store (Gloo
alone binds to what the hostname resolves to, loopback in many containers), and each
``init_process_group`` of the process at a fresh prefix of one store on
``MASTER_ADDR:MASTER_PORT`` — torch's own env:// rendezvous reuses its group names
after ``destroy_process_group()`` and, with the store still listening, the next group
read the last one's addresses and hung (pytorch#55967, #114585; a Spark Python worker or
a script that runs several programs forms more than one group). Installing it does not
import torch: until the program imports ``torch.distributed``, an import hook waits for
it (:func:`install`).
"""

from __future__ import annotations

import datetime
import functools
import importlib.abc
import importlib.machinery
import inspect
import logging
import os
import sys
from collections.abc import Callable
from typing import Any

from .. import _config as cfg
from .._errors import RendezvousError
from ..rendezvous import iface

log = logging.getLogger("ringtrain.ringcore")

__all__ = [
    "forget_earlier_meshes",
    "install",
    "release_user_group",
    "ringcore_formed",
    "set_ringcore_formed",
]

_formed_by_ringcore = False


def set_ringcore_formed(formed: bool) -> None:
    """``torch_ring`` says whether the default group is one it formed (and now left)."""
    global _formed_by_ringcore
    _formed_by_ringcore = formed


def ringcore_formed() -> bool:
    return _formed_by_ringcore


def _launcher_value(name: str) -> int | None:
    raw = cfg.get_env(name)
    try:
        return int(raw) if raw is not None else None
    except ValueError:
        return None


def _check_against_launcher(rank: Any, world_size: Any) -> None:
    """An explicit rank or world size that the launcher's says otherwise: an error
    naming both (the group could only time out)."""
    for asked, var, what in (
        (rank, cfg.RANK_ENV_VAR, "rank"),
        (world_size, cfg.SIZE_ENV_VAR, "world_size"),
    ):
        launched = _launcher_value(var)
        if launched is None or asked is None or int(asked) < 0 or int(asked) == launched:
            continue
        mine, size = _launcher_value(cfg.RANK_ENV_VAR), _launcher_value(cfg.SIZE_ENV_VAR)
        raise RendezvousError(
            f"init_process_group({what}={int(asked)}) disagrees with the launcher: this "
            f"worker is rank {mine} of {size} ({var}={launched}; torchrun's RANK and "
            f"WORLD_SIZE say the same). Call init_process_group() without rank= and "
            f"world_size= (env:// reads them), or launch the number of workers the "
            f"program expects."
        )


def _check_backend(dist: Any, backend: Any) -> None:
    """A group ringcore formed answers a program's ``init_process_group(backend)`` only
    when it has that backend for the devices the program will use."""
    if backend is None:
        return
    wanted = str(backend).lower()
    have = str(dist.get_backend_config()).lower()
    if "nccl" in wanted and "nccl" not in have:
        raise RendezvousError(
            f"init_process_group(backend={backend!r}): ringcore.init() already formed this "
            f"job's process group with {have!r}, which has no NCCL. Call "
            "init_process_group before hvd.init()/ringcore.init() (ringcore then uses the "
            "program's group), or launch with use_gpu=True so that ringcore forms "
            "cpu:gloo,cuda:nccl."
        )


#: the store of each ``MASTER_ADDR:MASTER_PORT`` this process met at, and how many groups
#: it formed there (each at its own prefix)
_env_stores: dict[tuple[str, int], Any] = {}
_env_groups = 0


def _launched_env_rendezvous(bound: dict[str, Any]) -> bool:
    """Whether this call is an env:// rendezvous of a job a ringtrain launcher started."""
    init_method = bound.get("init_method")
    return (
        bound.get("store") is None
        and init_method in (None, "env://")
        and cfg.get_env(cfg.RANK_ENV_VAR) is not None
        and all(os.environ.get(v) for v in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"))
    )


def _choose_interface() -> None:
    """Gloo on the interface on the route to the job's store (``iface.apply``, as for
    ringcore's own ring), unless the program or the launcher named one."""
    addr, port = cfg.get_env(cfg.STORE_ADDR_ENV_VAR), cfg.get_env(cfg.STORE_PORT_ENV_VAR)
    if not addr or not port or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    size = int(cfg.get_env(cfg.SIZE_ENV_VAR, "1") or 1)
    local_size = int(cfg.get_env(cfg.LOCAL_SIZE_ENV_VAR, str(size)) or size)
    iface.apply(addr, int(port), local_size < size and not iface.is_loopback(addr))


def _fresh_rendezvous(dist: Any, bound: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments with a store of its own: the next prefix of this process's
    store on ``MASTER_ADDR:MASTER_PORT`` (rank 0 hosts it, for the process's life)."""
    global _env_groups
    rank = int(bound.get("rank", -1))
    size = int(bound.get("world_size", -1))
    rank = rank if rank >= 0 else int(os.environ["RANK"])
    size = size if size >= 0 else int(os.environ["WORLD_SIZE"])
    timeout = bound.get("timeout") or datetime.timedelta(
        seconds=cfg.get_float(cfg.START_TIMEOUT_ENV_VAR, cfg.DEFAULT_START_TIMEOUT_S)
    )
    key = (os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))
    store = _env_stores.get(key)
    if store is None:
        store = dist.TCPStore(
            key[0], key[1], size, rank == 0, timeout=timeout, wait_for_workers=False
        )
        _env_stores[key] = store
    _env_groups += 1
    prefixed = dist.PrefixStore(f"ringtrain/group/{_env_groups}", store)
    return {**bound, "init_method": None, "store": prefixed, "rank": rank, "world_size": size}


def forget_earlier_meshes() -> None:
    """Forget the DTensor sharding decisions torch cached for earlier process groups.

    torch caches them by ``DeviceMesh``, and two meshes over the same ranks compare equal
    even when they were made from different groups. In a process that forms a second
    group (a Spark Python worker's next job, an elastic re-formation) as another rank, a
    cached decision handed the new job's tensors the old mesh, whose coordinate is this
    process's rank in the old job: FSDP2's state_dict then named the wrong shard, and a
    sharded checkpoint lost one ("Failed to validate global plan: ... invalid fill").
    Called before every group this process forms; a no-op until DTensor is imported."""
    if "torch.distributed.tensor" not in sys.modules:
        return  # nothing cached yet
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache

        _clear_sharding_prop_cache()  # the C++ fast path's cache and the Python one
    except (ImportError, AttributeError) as exc:  # another torch: say so, go on
        log.warning("could not clear torch's DTensor sharding cache (%s): a process that "
                    "runs several jobs may mix their meshes", exc)  # fmt: skip


def _guarded(original: Any) -> Any:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            return original(*args, **kwargs)  # torch's own error for a bad call
        _check_against_launcher(bound.get("rank"), bound.get("world_size"))
        import torch.distributed as dist

        if _formed_by_ringcore and dist.is_initialized():
            _check_backend(dist, bound.get("backend"))
            if "ring" in str(bound.get("backend") or "").lower():
                log.warning(
                    "init_process_group(backend=%r): ringcore.init() already formed this "
                    "job's group with %r, which the program now uses: its CPU collectives "
                    "go through Gloo, not the backend 'ring'. Call init_process_group before "
                    "hvd.init()/ringcore.init() to run the program on 'ring'.",
                    bound.get("backend"),
                    str(dist.get_backend_config()),
                )
            log.debug("init_process_group(): the job's group is already formed; using it")
            return None
        if not dist.is_initialized():
            forget_earlier_meshes()
        if not _launched_env_rendezvous(bound) or dist.is_initialized():
            return original(*args, **kwargs)  # torch's own way (and its own errors)
        _choose_interface()
        return original(**_fresh_rendezvous(dist, bound))

    init_process_group._ringcore_guard = True  # type: ignore[attr-defined]
    return init_process_group


#: what else runs once ``torch.distributed`` is imported in this process (``when_imported``)
_on_import: list[Callable[[Any], None]] = []


def when_imported(fn: Callable[[Any], None]) -> None:
    """Run ``fn(torch.distributed)`` now if it is imported, else right after the program
    imports it (the guard's import hook; :func:`install` first)."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "init_process_group"):
        fn(dist)
    elif fn not in _on_import:
        _on_import.append(fn)


def _patch(dist: Any) -> None:
    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d as c10d

    while _on_import:
        _on_import.pop(0)(dist)

    if getattr(c10d.init_process_group, "_ringcore_guard", False):
        return
    guarded = _guarded(c10d.init_process_group)
    c10d.init_process_group = guarded
    dist.init_process_group = guarded


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches ``torch.distributed`` right after it is first imported."""

    busy = False

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != "torch.distributed" or self.busy:
            return None
        self.busy = True
        try:
            spec = importlib.machinery.PathFinder.find_spec(name, path)
        finally:
            self.busy = False
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Guard ``torch.distributed.init_process_group`` in this process (idempotent): now
    when ``torch.distributed`` is imported, else when the program imports it."""
    dist = sys.modules.get("torch.distributed")
    if dist is not None and hasattr(dist, "init_process_group"):
        _patch(dist)
    elif not any(isinstance(f, _PatchOnImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnImport())


def release_user_group() -> None:
    """End a default process group the user's code formed and left (Lightning and the
    Hugging Face Trainer never destroy theirs): a process that runs the next job (a
    Spark Python worker, a Ray actor) must start it with none."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is None or _formed_by_ringcore or not dist.is_available():
            return
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception as exc:  # a dead peer must not fail the worker's own result
        log.debug("destroy_process_group of the user's group failed: %s", exc)
    finally:
        _env_stores.clear()  # the next job meets at its own MASTER_PORT
