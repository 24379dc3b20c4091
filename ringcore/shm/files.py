"""The shared-memory data plane's names in ``/dev/shm``: how they are made, the checks a
rank makes before it trusts one, and the sweep of the leftovers of dead groups.

**No name is trusted.** ``/dev/shm`` is world-writable (sticky): any local user may
create a file under a free name, and the name a rank opens comes from the job's store,
which any client can write (docs/security.md). So a rank opens the segment with
``O_NOFOLLOW`` (no symbolic link) and checks the open file (``fstat``: no race between
the check and the use): a regular file, owned by this process's effective uid, no
group or other permission bit, one link (not a hard link to another file of ours), of
the size the layout needs. The folder of the wake-up sockets gets the same checks (a
directory, mode 0700). A file that fails is refused (:class:`Unusable`), never mapped.

**Liveness.** Local rank 0 creates the segment unnamed (``O_TMPFILE``), takes a shared
OFD lock on it (``F_OFD_SETLK``: owned by the open file description, kept while any
descriptor or mapping of it lives, dropped by the kernel when the process dies, in any
pid namespace) and only then links it under its name, so the named segment of a live
group is always locked. The fast lane's mutex (``flock`` on ``Mapping.lock_fd``) is a
different lock: on Linux ``flock`` and OFD locks do not interact.

**Sweep** (:func:`sweep`, run by local rank 0 before it creates a segment): it removes
``ringshm-*`` entries that are ours (owner = effective uid), unchanged for
:data:`SWEEP_AGE_S`, and dead: a segment on which an exclusive OFD lock succeeds
without waiting (no creator holds it), a socket folder whose segment is gone. It never
waits on a lock and never touches another user's entries. The age only spares groups
of earlier ringtrain versions, which did not lock (their handshake waits up to 60 s).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import struct
import time

from .._errors import RingError

__all__ = [
    "DIR_SUFFIX",
    "NAME_PREFIX",
    "SWEEP_AGE_S",
    "Unusable",
    "create_segment",
    "ident",
    "make_socket_dir",
    "open_dir",
    "open_segment",
    "remove",
    "remove_socket_dir",
    "sweep",
]

NAME_PREFIX = "ringshm-"
DIR_SUFFIX = ".d"  # the wake-up sockets' folder: <segment name>.d
SWEEP_AGE_S = 60.0

log = logging.getLogger("ringtrain.ringcore.shm")


class Unusable(RingError):
    """A name in the shared-memory folder that this rank refuses to use; the message says
    which and why. Caught by the handshake (the group falls back to the network)."""


def ident(fd: int) -> tuple[int, int]:
    st = os.fstat(fd)
    return st.st_dev, st.st_ino


def _lock(fd: int, kind: int) -> bool:
    """An OFD lock of the whole file, without waiting; False if another holds a conflict."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, struct.pack("hhqqi4x", kind, os.SEEK_SET, 0, 0, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _check(fd: int, path: str, kind: str, size: int | None = None) -> None:
    """Refuse the open ``fd`` unless it is ours, private, of ``kind`` (and ``size``)."""
    st = os.fstat(fd)
    is_kind = stat.S_ISDIR(st.st_mode) if kind == "directory" else stat.S_ISREG(st.st_mode)
    why = None
    if not is_kind:
        why = f"it is not a {kind} (mode {stat.filemode(st.st_mode)})"
    elif st.st_uid != os.geteuid():
        why = f"it is owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}"
    elif st.st_mode & 0o077:
        why = f"its mode {stat.filemode(st.st_mode)} lets other users in (expected no group/other bits)"
    elif kind != "directory" and st.st_nlink != 1:
        why = f"it has {st.st_nlink} links (a hard link to another file?)"
    elif size is not None and st.st_size != size:
        why = (
            f"it holds {st.st_size} bytes, not the {size} this layout needs: pass the same "
            "local_size and slot_bytes on every local rank"
        )
    if why is not None:
        raise Unusable(f"{path}: {why}; refused")


def _open(shm_fd: int, shm_dir: str, name: str, flags: int) -> int:
    path = os.path.join(shm_dir, name)
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=shm_fd)
    except FileNotFoundError:
        raise Unusable(
            f"{path} does not exist in this rank's {shm_dir}: the local ranks do not share "
            f"{shm_dir} (containers need --ipc=host as well as --net=host), or it was removed"
        ) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise Unusable(f"{path} is a symbolic link; refused") from None
        if exc.errno in (errno.EISDIR, errno.ENOTDIR):
            kind = "a directory" if exc.errno == errno.EISDIR else "not a directory"
            raise Unusable(f"{path} is {kind}; refused") from None
        raise Unusable(f"{path} cannot be opened: {exc.strerror}") from None


def create_segment(shm_fd: int, name: str, size: int) -> int | None:
    """A new segment of ``size`` bytes, locked, then linked as ``name``: its fd, or None
    when the folder cannot reserve ``size`` (ENOSPC/ENOMEM; nothing is left behind)."""
    fd = os.open(".", os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600, dir_fd=shm_fd)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        _lock(fd, fcntl.F_RDLCK)  # our own new file: nobody else can hold a lock on it
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.ENOMEM):
                os.close(fd)
                return None
            raise
        os.link(f"/proc/self/fd/{fd}", name, dst_dir_fd=shm_fd, follow_symlinks=True)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        raise
    return fd


def open_segment(shm_fd: int, shm_dir: str, name: str, size: int) -> int:
    """The segment another rank created, checked; raises :class:`Unusable`."""
    fd = _open(shm_fd, shm_dir, name, os.O_RDWR)
    try:
        _check(fd, os.path.join(shm_dir, name), "regular file", size)
    except BaseException:
        os.close(fd)
        raise
    return fd


def make_socket_dir(shm_fd: int, name: str) -> int:
    """A new private folder ``name`` (mode 0700) for the wake-up sockets: its fd."""
    os.mkdir(name, 0o700, dir_fd=shm_fd)
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=shm_fd)
    os.fchmod(fd, 0o700)
    return fd


def open_dir(shm_fd: int, shm_dir: str, name: str) -> int:
    """The wake-up sockets' folder local rank 0 made, checked; raises :class:`Unusable`."""
    fd = _open(shm_fd, shm_dir, name, os.O_RDONLY | os.O_DIRECTORY)
    try:
        _check(fd, os.path.join(shm_dir, name), "directory")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _is(shm_fd: int, name: str, want: tuple[int, int]) -> bool:
    try:
        st = os.stat(name, dir_fd=shm_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == want


def remove(shm_fd: int, name: str, want: tuple[int, int]) -> None:
    """Unlink ``name`` if it still is the file ``want`` (dev, inode); gone is fine."""
    if _is(shm_fd, name, want):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=shm_fd)


def remove_socket_dir(shm_fd: int, name: str, dir_fd: int) -> None:
    """Empty the socket folder (through its fd) and remove it if ``name`` still is it."""
    for entry in os.listdir(dir_fd):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry, dir_fd=dir_fd)
    if _is(shm_fd, name, ident(dir_fd)):
        with contextlib.suppress(OSError):  # gone, or a peer is still emptying it
            os.rmdir(name, dir_fd=shm_fd)


def _sweep_segment(shm_fd: int, name: str) -> bool:
    fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=shm_fd)
    try:
        if os.fstat(fd).st_uid != os.geteuid() or not _lock(fd, fcntl.F_WRLCK):
            return False  # not ours, or its creator still lives
        remove(shm_fd, name, ident(fd))
        return True
    finally:
        os.close(fd)  # drops our lock


def _sweep_dir(shm_fd: int, name: str) -> bool:
    if _exists(shm_fd, name[: -len(DIR_SUFFIX)]):
        return False  # a live group's folder always has its segment beside it
    fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=shm_fd)
    try:
        if os.fstat(fd).st_uid != os.geteuid():
            return False
        remove_socket_dir(shm_fd, name, fd)
        return True
    finally:
        os.close(fd)


def _swept(how, shm_fd: int, name: str) -> bool:
    try:
        return how(shm_fd, name)
    except OSError:  # gone meanwhile, or not ours to touch: a sweep never fails a group
        return False


def sweep(shm_dir: str, age_s: float = SWEEP_AGE_S) -> list[str]:
    """Remove the leftovers of dead groups from ``shm_dir`` (see the module's docstring);
    returns their paths."""
    try:
        shm_fd = os.open(shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    try:
        old, euid, now = [], os.geteuid(), time.time()
        for entry in os.scandir(shm_fd):
            if entry.name.startswith(NAME_PREFIX):
                with contextlib.suppress(OSError):
                    st = entry.stat(follow_symlinks=False)
                    if st.st_uid == euid and now - st.st_mtime >= age_s:
                        old.append((entry.name, st.st_mode))
        gone = [n for n, m in old if stat.S_ISREG(m) and _swept(_sweep_segment, shm_fd, n)]
        gone += [
            n
            for n, m in old
            if stat.S_ISDIR(m) and n.endswith(DIR_SUFFIX) and _swept(_sweep_dir, shm_fd, n)
        ]
    finally:
        os.close(shm_fd)
    if gone:
        log.info("removed leftovers of dead shared-memory groups from %s: %s", shm_dir, gone)
    return [os.path.join(shm_dir, n) for n in gone]


def _exists(shm_fd: int, name: str) -> bool:
    try:
        os.stat(name, dir_fd=shm_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True
