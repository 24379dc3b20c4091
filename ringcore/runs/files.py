"""Whole-file writes and fsync on a POSIX filesystem, for every run's files.

Used by :class:`~ringcore.runs.stores.LocalRunStore` (the estimators' ``LocalStore``)
and by ray_runner's run folder (its commit records, its checkpoints' files).

:func:`write_file` writes a file to a temporary name beside it
(``<path>.tmp-<pid>-<8 hex>``), fsyncs it, renames it over ``path`` and fsyncs the folder,
so a reader sees the old file or the new one, and a host crash cannot leave an empty
``path``. Its writer holds an exclusive ``flock`` on the temporary file from its creation
until the rename: the kernel drops that lock when the process ends, even SIGKILLed, so a
locked temporary is a live writer's and an unlocked one a dead writer's.
:func:`remove_dead_temps` removes only the dead ones, never another writer's file in
flight.

:func:`run_lock` is an exclusive ``flock`` on a lock file, held across a check and a
rename (``write_file(lock=..., before_commit=...)``): the check holds at the commit point.
LocalStore's checkpoint fencing rests on it (see ``ringcore.runs.checkpoints``). flock
excludes processes across the hosts of a local disk and of NFS (Linux maps it onto NFS
byte-range locks); on a FUSE mount that keeps locks on one host it excludes that host's
writers only. A filesystem that refuses locks (ENOLCK: NFS without a lock manager) fails
the write with an error saying so, rather than writing unfenced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import os
import re
import time
import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

__all__ = [
    "LOCK_TIMEOUT_S",
    "PREVIOUS_SUFFIX",
    "fsync_path",
    "fsync_tree",
    "remove_dead_temps",
    "run_lock",
    "temp_name",
    "write_file",
]

PREVIOUS_SUFFIX = ".prev"  # the file a write replaced, kept beside it
TEMP_INFIX = ".tmp-"
#: what follows ``path`` in a temporary's name: ours (pid, random) or an older version's
_TEMP_SUFFIX = re.compile(r"^\.tmp-(?:\d+-)?[0-9a-f]{8}$")
#: how long a writer waits for a run's lock, held only across a check and a rename
LOCK_TIMEOUT_S = 120.0


def fsync_path(path: str, directory: bool = False) -> None:
    """fsync ``path``; a filesystem that cannot fsync (a folder on some FUSE mounts) is
    let be, any other failure (EIO: the data did not reach the disk) raises."""
    fd = os.open(path, os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if directory else 0))
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def fsync_tree(path: str) -> None:
    """fsync every file and folder under the local ``path``, folders after their
    entries (a crash leaves the tree whole or absent once this returns)."""
    for folder, _, files in os.walk(path, topdown=False):
        for file in files:
            fsync_path(os.path.join(folder, file))
        fsync_path(folder, directory=True)


def temp_name(path: str) -> str:
    """A temporary name beside ``path`` that is this writer's own
    (``<path>.tmp-<pid>-<8 hex>``)."""
    return f"{path}{TEMP_INFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}"


def _flock(fd: int, flags: int, path: str) -> bool:
    """``flock(fd, flags)``: False when another holder has it (non-blocking); an OSError
    naming ``path`` and the fix when the filesystem has no locks."""
    try:
        fcntl.flock(fd, flags)
    except BlockingIOError:
        return False
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"the filesystem of {path} refuses file locks ({exc.strerror}); the store needs "
            "them to keep a stale task's checkpoint from replacing the current one. Mount it "
            "with locking (NFS: v4, or v3 with its lock manager), or use an object-store URL",
        ) from exc
    return True


def _same_file(path: str, fd: int) -> bool:
    try:
        here, ours = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (ours.st_dev, ours.st_ino)


@contextlib.contextmanager
def run_lock(path: str, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """An exclusive flock on the lock file ``path`` (created if missing, never removed),
    for the block; a TimeoutError naming it when another holder keeps it ``timeout_s``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    try:
        deadline, delay = time.monotonic() + timeout_s, 0.002
        while not _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, path):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the lock {path} was held by another writer for over {timeout_s:.0f} s, "
                    "though a writer holds it only across a rename: that process is stopped "
                    "or hung (kill it), or its host lost the store's mount"
                )
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        yield
    finally:
        os.close(fd)


@contextlib.contextmanager
def _locked_temp(path: str) -> Iterator[tuple[str, BinaryIO]]:
    """A new temporary file beside ``path``, open for writing and flocked by this writer
    for the block; removed at its end unless it was renamed."""
    for _ in range(3):
        tmp = temp_name(path)
        f = os.fdopen(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644), "wb")
        try:
            _flock(f.fileno(), fcntl.LOCK_EX, tmp)
        except BaseException:
            f.close()
            raise
        if _same_file(tmp, f.fileno()):
            break
        f.close()  # a cleaner took it for a dead writer's between the create and the lock
    else:
        raise OSError(errno.EAGAIN, f"could not keep a temporary file beside {path}")
    try:
        yield tmp, f
    finally:
        with contextlib.suppress(FileNotFoundError):
            if _same_file(tmp, f.fileno()):
                os.remove(tmp)
        f.close()


def remove_dead_temps(path: str) -> None:
    """Remove the temporaries of ``path`` that no live writer holds (a writer killed
    mid-write left them); a live writer's, locked, stays."""
    for name in glob.glob(glob.escape(path) + TEMP_INFIX + "*"):
        if not _TEMP_SUFFIX.match(name[len(path) :]):
            continue
        try:
            fd = os.open(name, os.O_RDWR)
        except OSError:
            continue  # renamed or removed meanwhile
        try:
            if _flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB, name) and _same_file(name, fd):
                os.remove(name)
        except OSError:
            pass  # a cleanup that fails leaves a file, never fails the write it follows
        finally:
            os.close(fd)


def write_file(
    path: str,
    write: Callable[[BinaryIO], object],
    *,
    keep_previous: Callable[[str], bool] | None = None,
    lock: str | None = None,
    before_commit: Callable[[], None] | None = None,
) -> None:
    """``write(file)`` to a temporary, fsynced, then renamed to ``path`` (see the module
    docstring). ``keep_previous(path)`` true: the file replaced stays as
    ``<path>.prev`` (:data:`PREVIOUS_SUFFIX`). ``lock``: the rename happens holding :func:`run_lock` on it, right
    after ``before_commit()``, which may raise to refuse the write (nothing changes)."""
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    with _locked_temp(path) as (tmp, f):
        write(f)
        f.flush()
        os.fsync(f.fileno())
        with run_lock(lock) if lock is not None else contextlib.nullcontext():
            if before_commit is not None:
                before_commit()
            if keep_previous is not None and keep_previous(path):
                os.replace(path, path + PREVIOUS_SUFFIX)
            os.replace(tmp, path)
            fsync_path(folder, directory=True)
            remove_dead_temps(path)
