"""The shared-memory segment of one host's ranks: its layout, creation, and the handshake.

Local rank 0 checks the free space of ``/dev/shm`` (``os.statvfs``), creates
``/dev/shm/ringshm-<prefix>-<token>`` (``O_EXCL``, mode 0600), reserves its pages with
``posix_fallocate`` (a full ``/dev/shm`` fails here with ENOSPC, not later with
SIGBUS) and publishes the name through the store. Every rank maps it, writes its pid
into its control line and counts itself in with ``store.add``; the rank whose count
completes the group unlinks the file and says so. From then on the segment lives only
as long as some rank maps it: a SIGKILLed rank leaves nothing in ``/dev/shm``. A rank
that fails during the handshake unlinks the file too (ignoring one already gone).

Each rank keeps its own open file description of the segment (``Mapping.lock_fd``):
``flock`` on it is the group's one cross-process mutex (the fast lane's proposals), and
the kernel releases it when a rank dies holding it.

We open and ``mmap`` the file directly instead of using
``multiprocessing.shared_memory``, whose resource tracker would warn about (or unlink)
the segment when a process exits.

Layout (all offsets 64-byte aligned, int64 words)::

    [0, 64)              header: magic, version, local_size, slot_bytes, then the
                         fast lane's proposal: id, cache id, voters, state (``_shm_vote``)
    [64, 64 + 64 L)      one control line per rank: seq, pid, sleeping, closed, busy
    meta                 2 banks x L ranks x meta_words: each op's descriptor
    data (4 KiB aligned) 2 banks x L slots of slot_bytes
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import logging
import mmap
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ._errors import RingError

__all__ = [
    "DEFAULT_SLOT_BYTES",
    "SHM_ENV_VAR",
    "Layout",
    "Mapping",
    "free_bytes",
    "map_segment",
    "shm_enabled",
]

SHM_ENV_VAR = "RING_SHM"
DEFAULT_SLOT_BYTES = 1 << 20  # measured best of 256 KiB .. 4 MiB (16 MB allreduce, 2 ranks)
MAGIC = 0x52494E4753484D31  # "RINGSHM1"
VERSION = 2  # 2: the header carries the fast lane's proposal
CTRL_WORDS = 8  # one 64-byte line per rank
META_FIXED = 24  # descriptor words before the alltoall splits
BANKS = 2

log = logging.getLogger("ringtrain.ringcore.shm")


def shm_enabled() -> bool:
    """False when ``RING_SHM`` is 0/false/no/off: the ranks of a host then use the network."""
    return os.environ.get(SHM_ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


def free_bytes(path: str) -> int:
    """Bytes an unprivileged process may still allocate under ``path``."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def _align(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Layout:
    """Where everything lies in a segment for ``local_size`` ranks and ``slot_bytes`` slots."""

    local_size: int
    slot_bytes: int

    def __post_init__(self) -> None:
        if self.local_size < 1:
            raise ValueError(f"local_size must be >= 1, got {self.local_size}")
        if self.slot_bytes < 4096 or self.slot_bytes % 64:
            raise ValueError(
                f"slot_bytes must be a multiple of 64 and >= 4096, got {self.slot_bytes}"
            )

    @property
    def meta_words(self) -> int:
        return _align(META_FIXED + self.local_size, 8)

    @property
    def ctrl_offset(self) -> int:
        return 64

    @property
    def meta_offset(self) -> int:
        return self.ctrl_offset + 64 * self.local_size

    @property
    def data_offset(self) -> int:
        meta_bytes = BANKS * self.local_size * self.meta_words * 8
        return _align(self.meta_offset + meta_bytes, 4096)

    @property
    def bank_bytes(self) -> int:
        return self.local_size * self.slot_bytes

    @property
    def size(self) -> int:
        return self.data_offset + BANKS * self.bank_bytes


@dataclass
class Mapping:
    """A mapped segment: the ``mmap`` and the token that names the job's wake-up sockets."""

    mm: mmap.mmap
    token: str
    layout: Layout
    lock_fd: int = -1  # this rank's own open file description of the segment, for flock


def _segment_name(prefix: str, token: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", prefix)[-48:].strip("._") or "job"
    return f"ringshm-{safe}-{token}"


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _too_small_message(shm_dir: str, free: int | None, need: int, local_size: int) -> str:
    mib = need / 2**20
    have = "does not exist" if free is None else f"has {free / 2**20:.0f} MiB free"
    return (
        f"{shm_dir} {have} but the shared-memory data plane of {local_size} local ranks "
        f"needs {mib:.0f} MiB; these ranks fall back to the network path. Give the "
        f"container more shared memory (docker run --shm-size=1g, or "
        f"mount -o remount,size=1G {shm_dir}), or set {SHM_ENV_VAR}=0 to silence this."
    )


def _create_file(shm_dir: str, name: str, size: int) -> int | None:
    """The new segment's fd, or None (file removed) when tmpfs cannot reserve ``size``."""
    path = os.path.join(shm_dir, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        os.close(fd)
        _unlink(path)
        if exc.errno in (errno.ENOSPC, errno.ENOMEM):
            return None
        raise
    except BaseException:
        os.close(fd)
        _unlink(path)
        raise
    return fd


def _map(fd: int, layout: Layout) -> tuple[mmap.mmap, int]:
    """The mapping, and a duplicate of ``fd`` kept for ``flock`` (``fd`` itself is closed)."""
    try:
        size = os.fstat(fd).st_size
        if size != layout.size:
            raise RingError(
                f"the shared-memory segment holds {size} bytes but local_size="
                f"{layout.local_size}, slot_bytes={layout.slot_bytes} need {layout.size}; "
                "pass the same local_size and slot_bytes on every local rank."
            )
        mm = mmap.mmap(fd, layout.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        return mm, os.dup(fd)
    finally:
        os.close(fd)


def _wait(store: Any, key: str, timeout_s: float, what: str) -> bytes:
    try:
        store.wait([key], datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:
        raise RingError(
            f"shared-memory setup timed out after {timeout_s:.0f} s waiting for {what} "
            f"(store key {key!r}); start every local rank or raise timeout_s."
        ) from exc
    return store.get(key)


def _write_header(mm: mmap.mmap, layout: Layout) -> None:
    hdr = memoryview(mm)[:64].cast("q")
    hdr[0], hdr[1], hdr[2], hdr[3] = MAGIC, VERSION, layout.local_size, layout.slot_bytes
    hdr.release()


def _check_header(mm: mmap.mmap, layout: Layout) -> None:
    hdr = memoryview(mm)[:64].cast("q")
    found = tuple(hdr[:4])
    hdr.release()
    want = (MAGIC, VERSION, layout.local_size, layout.slot_bytes)
    if found != want:
        raise RingError(
            f"the shared-memory segment's header is {found}, expected {want} (magic, version, "
            "local_size, slot_bytes); every local rank must run the same ringtrain with the "
            "same local_size and slot_bytes."
        )


def map_segment(
    store: Any,
    prefix: str,
    local_rank: int,
    layout: Layout,
    *,
    timeout_s: float,
    shm_dir: str,
    free_space: Callable[[str], int],
    on_mapped: Callable[[mmap.mmap, str], None],
) -> Mapping | None:
    """Create (rank 0) or map the segment, run ``on_mapped(mm, token)`` (write the pid, bind
    the wake-up socket) and count in; return once the file is unlinked. None: no room."""
    keys = f"{prefix}/shm/name", f"{prefix}/shm/mapped", f"{prefix}/shm/unlinked"
    path = ""
    mapping: Mapping | None = None
    try:
        if local_rank == 0:
            mapping = _create(store, keys[0], prefix, layout, shm_dir, free_space)
            if mapping is None:
                return None
            path = os.path.join(shm_dir, _segment_name(prefix, mapping.token))
        else:
            token = _wait(store, keys[0], timeout_s, "local rank 0 to create the segment")
            if not token:
                log.debug("local rank 0 found no room in %s; using the network path", shm_dir)
                return None
            path = os.path.join(shm_dir, _segment_name(prefix, token.decode()))
            mm, lock_fd = _map(os.open(path, os.O_RDWR), layout)
            mapping = Mapping(mm, token.decode(), layout, lock_fd)
            _check_header(mapping.mm, layout)
        on_mapped(mapping.mm, mapping.token)
        if store.add(keys[1], 1) == layout.local_size:
            _unlink(path)  # the last rank to map removes the name
            store.set(keys[2], "1")
        _wait(store, keys[2], timeout_s, "every local rank to map the segment")
        return mapping
    except BaseException:
        if path:
            _unlink(path)
        if mapping is not None and mapping.lock_fd >= 0:
            os.close(mapping.lock_fd)
        raise


def _create(
    store: Any,
    key: str,
    prefix: str,
    layout: Layout,
    shm_dir: str,
    free_space: Callable[[str], int],
) -> Mapping | None:
    """Rank 0: the new segment, or None (and ``""`` published) when ``shm_dir`` lacks room."""
    free = free_space(shm_dir) if os.path.isdir(shm_dir) else None
    fd = None
    token = secrets.token_hex(8)
    if free is not None and free >= layout.size:
        fd = _create_file(shm_dir, _segment_name(prefix, token), layout.size)
    if fd is None:
        log.warning(_too_small_message(shm_dir, free, layout.size, layout.local_size))
        store.set(key, "")
        return None
    path = os.path.join(shm_dir, _segment_name(prefix, token))
    try:
        mm, lock_fd = _map(fd, layout)
    except BaseException:
        _unlink(path)
        raise
    try:
        _write_header(mm, layout)
    except BaseException:
        _unlink(path)
        os.close(lock_fd)
        raise
    store.set(key, token)
    return Mapping(mm, token, layout, lock_fd)
