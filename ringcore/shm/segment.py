"""The shared-memory segment of one host's ranks: its layout and its header.

Local rank 0 creates ``/dev/shm/ringshm-<prefix>-<token>`` (mode 0600, its pages
reserved with ``posix_fallocate``: a full ``/dev/shm`` fails there with ENOSPC, not
later with SIGBUS); every rank checks and maps it; once every rank has mapped it the
name is unlinked, so from then on the segment lives only as long as some rank maps it.
How it is created, checked and swept: ``files``; the handshake: ``handshake``.

Each rank keeps its own open file description of the segment (``Mapping.lock_fd``):
``flock`` on it is the group's one cross-process mutex (the fast lane's proposals), and
the kernel releases it when a rank dies holding it.

We open and ``mmap`` the file directly instead of using
``multiprocessing.shared_memory``, whose resource tracker would warn about (or unlink)
the segment when a process exits.

Layout (all offsets 64-byte aligned, int64 words)::

    [0, 64)              header: magic, version, local_size, slot_bytes, then the
                         fast lane's proposal: id, cache id, voters, state (``vote``)
    [64, 64 + 64 L)      one control line per rank: seq, pid, sleeping, closed, busy
    meta                 2 banks x L ranks x meta_words: each op's descriptor
    data (4 KiB aligned) 2 banks x L slots of slot_bytes
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import socket
from dataclasses import dataclass, field

from .files import NAME_PREFIX, Unusable

__all__ = [
    "DEFAULT_SLOT_BYTES",
    "SHM_ENV_VAR",
    "Layout",
    "Mapping",
    "check_header",
    "free_bytes",
    "segment_name",
    "shm_enabled",
    "too_small_message",
    "write_header",
]

SHM_ENV_VAR = "RING_SHM"
DEFAULT_SLOT_BYTES = 1 << 20  # measured best of 256 KiB .. 4 MiB (16 MB allreduce, 2 ranks)
MAGIC = 0x52494E4753484D31  # "RINGSHM1"
VERSION = 2  # 2: the header carries the fast lane's proposal
CTRL_WORDS = 8  # one 64-byte line per rank
META_FIXED = 24  # descriptor words before the alltoall splits
BANKS = 2


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
    """One rank's share of a formed group: the mapped segment, this rank's own open file
    description of it (``lock_fd``, for ``flock``), its wake-up socket and one socket
    connected to each peer's (``senders``; ``sync``)."""

    mm: mmap.mmap
    layout: Layout
    lock_fd: int
    sock: socket.socket
    senders: dict[int, socket.socket] = field(default_factory=dict)

    def close(self) -> None:
        """Release it all (a group that failed to start on this rank)."""
        for s in [*self.senders.values(), self.sock]:
            s.close()
        with contextlib.suppress(BufferError):  # a view still alive: the GC unmaps it
            self.mm.close()
        if self.lock_fd >= 0:
            os.close(self.lock_fd)
            self.lock_fd = -1


def segment_name(prefix: str, token: str) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", prefix)[-48:].strip("._") or "job"
    return f"{NAME_PREFIX}{safe}-{token}"


def too_small_message(shm_dir: str, free: int | None, need: int, local_size: int) -> str:
    mib = need / 2**20
    have = "does not exist" if free is None else f"has {free / 2**20:.0f} MiB free"
    return (
        f"{shm_dir} {have} but the shared-memory data plane of {local_size} local ranks "
        f"needs {mib:.0f} MiB; these ranks fall back to the network path. Give the "
        f"container more shared memory (docker run --shm-size=1g, or "
        f"mount -o remount,size=1G {shm_dir}), or set {SHM_ENV_VAR}=0 to silence this."
    )


def write_header(mm: mmap.mmap, layout: Layout) -> None:
    hdr = memoryview(mm)[:64].cast("q")
    hdr[0], hdr[1], hdr[2], hdr[3] = MAGIC, VERSION, layout.local_size, layout.slot_bytes
    hdr.release()


def check_header(mm: mmap.mmap, layout: Layout, path: str) -> None:
    """Raise :class:`~ringcore.shm.files.Unusable` unless the header is ours for ``layout``."""
    hdr = memoryview(mm)[:64].cast("q")
    found = tuple(hdr[:4])
    hdr.release()
    want = (MAGIC, VERSION, layout.local_size, layout.slot_bytes)
    if found != want:
        raise Unusable(
            f"{path}: its header is {found}, expected {want} (magic, version, local_size, "
            "slot_bytes); every local rank must run the same ringtrain with the same "
            "local_size and slot_bytes"
        )
