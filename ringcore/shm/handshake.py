"""How the local ranks of a host form their shared-memory group, or agree not to.

1. Local rank 0 sweeps the leftovers of dead groups (``files.sweep``), checks the
   room in ``/dev/shm``, creates the segment (locked before it is named) and the
   private folder of the wake-up sockets, writes the header and publishes the
   segment's token in the store under ``<prefix>/shm/name``, signed with the job's
   secret: ``<token>.<hex HMAC-SHA256(RING_SECRET_KEY, "ringcore/shm-segment", prefix,
   token)>`` (the bare token when the job has no secret). Without room it logs one
   warning and publishes ``""``: every rank returns None at once.
2. Every other rank checks the token's form and its signature, then opens and checks
   the segment and the folder (``files``: ours, private, not a link), maps the
   segment and checks its header. Each rank writes its pid into its control line,
   binds its wake-up socket and posts its outcome under ``<prefix>/shm/ready/<local
   rank>``: ``ok``, or why not.
3. Every rank waits for the L outcomes. If one is not ``ok``, every rank releases what
   it holds and returns None (``join`` then keeps the whole world on the network); the
   lowest failing local rank logs the one warning, which names the file and why.
4. Otherwise each rank connects a socket to every peer's and posts
   ``<prefix>/shm/connected/<local rank>``; once all have, each removes the names (the
   socket names, their folder, then the segment's; a name only while it still is the
   file this rank opened, so whichever rank comes first does it) and returns its
   :class:`~ringcore.shm.segment.Mapping`.

A failure thus costs the ranks one exchange through the store, not the timeout; only
a rank that never arrives keeps the others waiting ``timeout_s`` (then a
:class:`RingError` names it). A client of the (unauthenticated) store that writes
these keys can make the ranks fall back to the network or time out, never map or bind
a file they did not make (docs/security.md).
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
import socket
from collections.abc import Callable
from typing import Any

from .._auth import job_secret, mac, verify
from .._errors import RingError
from .files import (
    DIR_SUFFIX,
    Unusable,
    create_segment,
    ident,
    make_socket_dir,
    open_dir,
    open_segment,
    remove,
    remove_socket_dir,
    sweep,
)
from .segment import (
    CTRL_WORDS,
    Layout,
    Mapping,
    check_header,
    segment_name,
    too_small_message,
    write_header,
)
from .sync import PID, bind_socket, connect_peers

__all__ = ["map_segment"]

log = logging.getLogger("ringtrain.ringcore.shm")

OK = "ok"
_LABEL = "ringcore/shm-segment"  # the HMAC's domain: no other use of the secret yields it
_TOKEN = re.compile(r"[0-9a-f]{16}")


def _sign(secret: str | None, prefix: str, token: str) -> str:
    return token if secret is None else f"{token}.{mac(secret, _LABEL, prefix, token).hex()}"


def _check_name(
    value: str, prefix: str, secret: str | None, key: str, shm_dir: str
) -> tuple[str, str]:
    """The token of the published ``value`` and OK, or ``""`` and why it is refused."""
    token, dot, tag = value.partition(".")
    said = f"the segment name {value[:80]!r} under store key {key!r}"
    if not _TOKEN.fullmatch(token):
        return "", f"{said} is not one ringtrain makes (another store client wrote it); refused"
    said += f" (for {os.path.join(shm_dir, segment_name(prefix, token))})"
    if secret is None and dot:
        return (
            "",
            f"{said} is signed but this rank has no RING_SECRET_KEY; give every rank the same",
        )
    if secret is not None and not verify(mac(secret, _LABEL, prefix, token).hex(), tag):
        return "", (
            f"{said} is not signed with the job's secret (RING_SECRET_KEY): another store "
            "client wrote it, or the local ranks were given different secrets; refused"
        )
    return token, OK


def _wait(store: Any, keys: list[str], timeout_s: float, what: str) -> list[str]:
    try:
        store.wait(keys, datetime.timedelta(seconds=timeout_s))
    except RuntimeError as exc:  # DistStoreError is one
        missing = [k for k in keys if not store.check([k])]
        raise RingError(
            f"shared-memory setup timed out after {timeout_s:.0f} s waiting for {what} "
            f"(store keys {missing}); start every local rank or raise timeout_s."
        ) from exc
    return [store.get(k).decode("utf-8", "replace") for k in keys]


def _agree(
    store: Any, prefix: str, stage: str, rank: int, size: int, outcome: str, timeout_s: float
) -> tuple[int, str] | None:
    """Post this rank's ``outcome`` of ``stage``, wait for every local rank's: the lowest
    failing local rank and its reason, or None when all are ``ok``."""
    store.set(f"{prefix}/shm/{stage}/{rank}", outcome)
    keys = [f"{prefix}/shm/{stage}/{j}" for j in range(size)]
    outcomes = _wait(store, keys, timeout_s, f"every local rank ({stage})")
    return next(((j, why) for j, why in enumerate(outcomes) if why != OK), None)


class _Side:
    """What this rank opened during the handshake: handed over, or released."""

    def __init__(self, shm_dir: str, prefix: str, token: str, layout: Layout, rank: int):
        self.shm_dir, self.token = shm_dir, token
        self.name = segment_name(prefix, token) if token else ""
        self.layout, self.rank = layout, rank
        self.shm_fd = self.fd = self.dir_fd = -1
        self.seg: tuple[int, int] | None = None  # (dev, inode) of the segment we opened
        self.mm: mmap.mmap | None = None
        self.sock: socket.socket | None = None
        self.senders: dict[int, socket.socket] = {}

    @property
    def path(self) -> str:
        return os.path.join(self.shm_dir, self.name)

    def attempt(self, step: Callable[[], Any]) -> str:
        """OK, or why ``step`` failed (a refused file, any OSError)."""
        try:
            step()
        except Unusable as exc:
            return str(exc)
        except OSError as exc:
            return f"{self.path}: {exc}"
        return OK

    def _open_folder(self) -> None:
        try:
            self.shm_fd = os.open(self.shm_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise Unusable(f"{self.shm_dir} does not exist on this rank") from None

    def _adopt(self, fd: int) -> None:
        self.fd, self.seg = fd, ident(fd)
        prot = mmap.PROT_READ | mmap.PROT_WRITE
        self.mm = mmap.mmap(fd, self.layout.size, mmap.MAP_SHARED, prot)

    def create(self) -> bool:
        """Local rank 0: the segment and the socket folder; False: no room after all."""
        self._open_folder()
        fd = create_segment(self.shm_fd, self.name, self.layout.size)
        if fd is None:
            return False
        self._adopt(fd)
        assert self.mm is not None
        write_header(self.mm, self.layout)
        self.dir_fd = make_socket_dir(self.shm_fd, self.name + DIR_SUFFIX)
        return True

    def open(self) -> None:
        """Another local rank: the segment and the folder rank 0 made, checked."""
        self._open_folder()
        self._adopt(open_segment(self.shm_fd, self.shm_dir, self.name, self.layout.size))
        assert self.mm is not None
        check_header(self.mm, self.layout, self.path)
        self.dir_fd = open_dir(self.shm_fd, self.shm_dir, self.name + DIR_SUFFIX)

    def bind(self) -> None:
        """Write this rank's pid into its control line and bind its wake-up socket."""
        assert self.mm is not None
        ctrl = memoryview(self.mm)[self.layout.ctrl_offset : self.layout.meta_offset].cast("q")
        ctrl[self.rank * CTRL_WORDS + PID] = os.getpid()
        ctrl.release()
        try:
            self.sock = bind_socket(self.dir_fd, self.rank)
        except OSError as exc:
            where = f"{self.path}{DIR_SUFFIX}/{self.rank}"
            if exc.errno == errno.EADDRINUSE:
                raise Unusable(
                    f"the wake-up socket {where} is taken: another process of this user "
                    "bound it first; refused"
                ) from None
            raise Unusable(f"the wake-up socket {where} cannot be bound: {exc.strerror}") from None

    def connect(self) -> None:
        try:
            self.senders = connect_peers(self.dir_fd, self.rank, self.layout.local_size)
        except OSError as exc:
            where = f"{self.path}{DIR_SUFFIX}"
            raise Unusable(f"the wake-up sockets in {where} cannot be reached: {exc}") from None

    def _remove_names(self) -> None:
        if self.dir_fd >= 0:
            remove_socket_dir(self.shm_fd, self.name + DIR_SUFFIX, self.dir_fd)
        if self.seg is not None:
            remove(self.shm_fd, self.name, self.seg)

    def _close_fds(self) -> None:
        for fd in (self.dir_fd, self.shm_fd):
            if fd >= 0:
                os.close(fd)
        self.dir_fd = self.shm_fd = -1

    def handover(self) -> Mapping:
        """The group is formed: remove its names, keep the mapping and the sockets."""
        with contextlib.suppress(OSError):  # a peer removes them too; else the sweep will
            self._remove_names()
        self._close_fds()
        assert self.mm is not None and self.sock is not None
        out = Mapping(self.mm, self.layout, self.fd, self.sock, self.senders)
        self.mm, self.sock, self.senders, self.fd = None, None, {}, -1
        return out

    def release(self) -> None:
        """Close and unmap everything this rank holds; remove the names it made or opened."""
        for s in [*self.senders.values(), *([self.sock] if self.sock else [])]:
            s.close()
        self.senders, self.sock = {}, None
        if self.shm_fd >= 0:
            with contextlib.suppress(OSError):
                self._remove_names()
        self._close_fds()
        if self.mm is not None:
            self.mm.close()
            self.mm = None
        if self.fd >= 0:
            os.close(self.fd)  # drops the creator's lock: the name is gone already
            self.fd = -1


def _create(
    prefix: str, layout: Layout, shm_dir: str, free_space: Callable[[str], int]
) -> _Side | None:
    """Local rank 0: the new segment; None (after the one warning) without one."""
    sweep(shm_dir)
    free = free_space(shm_dir) if os.path.isdir(shm_dir) else None
    message = too_small_message(shm_dir, free, layout.size, layout.local_size)
    if free is None or free < layout.size:
        log.warning(message)
        return None
    side = _Side(shm_dir, prefix, secrets.token_hex(8), layout, 0)
    try:
        if side.create():
            return side
    except (Unusable, OSError) as exc:  # statvfs said yes; the file system said no
        message = (
            f"local rank 0 cannot create the shared-memory segment {side.path}: {exc}; "
            "these ranks fall back to the network path (set RING_SHM=0 to silence this)."
        )
    except BaseException:
        side.release()
        raise
    side.release()  # nothing stays behind
    log.warning(message)
    return None


def _say(failed: tuple[int, str], me: int) -> None:
    j, why = failed
    if j == me:  # the lowest failing rank speaks for the group
        log.warning(
            "the shared-memory data plane is off for this ring: local rank %d cannot use it: "
            "%s. Every local rank of this host uses the network path (set RING_SHM=0 to "
            "silence this).",
            j,
            why,
        )
    else:
        log.debug("local rank %d cannot use the shared-memory segment (%s); network path", j, why)


def map_segment(
    store: Any,
    prefix: str,
    local_rank: int,
    layout: Layout,
    *,
    timeout_s: float,
    shm_dir: str,
    free_space: Callable[[str], int],
) -> Mapping | None:
    """Form the group of ``layout.local_size`` local ranks (every one calls this) and
    return this rank's share of it, or None when every rank agreed to use the network."""
    key, size = f"{prefix}/shm/name", layout.local_size
    if local_rank == 0:
        made = _create(prefix, layout, shm_dir, free_space)
        if made is None:
            store.set(key, "")
            return None
        side, outcome = made, OK
    else:
        (value,) = _wait(store, [key], timeout_s, "local rank 0 to create the segment")
        if not value:
            log.debug("local rank 0 made no segment in %s; using the network path", shm_dir)
            return None
        token, outcome = _check_name(value, prefix, job_secret(), key, shm_dir)
        side = _Side(shm_dir, prefix, token, layout, local_rank)
        if outcome == OK:
            outcome = side.attempt(side.open)
    try:
        if local_rank == 0:
            store.set(key, _sign(job_secret(), prefix, side.token))
        if outcome == OK:
            outcome = side.attempt(side.bind)
        failed = _agree(store, prefix, "ready", local_rank, size, outcome, timeout_s)
        if failed is None:
            outcome = side.attempt(side.connect)
            failed = _agree(store, prefix, "connected", local_rank, size, outcome, timeout_s)
        if failed is not None:
            _say(failed, local_rank)
            side.release()
            return None
        return side.handover()
    except BaseException:
        side.release()
        raise
