"""Another local user, for the shared-memory tests: a forked child that drops to uid and
gid 65534 (``nobody``) before it acts. Playing it needs root (``needs_root`` skips the
tests elsewhere). No exec: this interpreter may live where ``nobody`` cannot read.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import pytest

from ringcore.shm.segment import MAGIC, VERSION

__all__ = ["NOBODY", "SHM", "collect", "fork_as", "needs_root", "plant"]

NOBODY = 65534
SHM = "/dev/shm"
needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="plays another local user with setuid(65534): needs root"
)


def fork_as(action, *args, uid: int | None = NOBODY) -> tuple[int, int]:
    """Fork a child that becomes ``uid`` (and its gid; None: stays us) and runs
    ``action(*args)``: it writes the JSON of the result (a dict) to a pipe, then holds on
    for the result's ``hold_s`` (keeping what it bound) and exits. Returns (pid, read
    end of the pipe)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        try:
            os.close(r)
            if uid is not None:
                os.setgroups([])
                os.setgid(uid)
                os.setuid(uid)
            result = action(*args)
        except BaseException as exc:
            result = {"error": f"{type(exc).__name__}: {exc}"}
        os.write(w, json.dumps(result).encode() + b"\n")
        time.sleep(float(result.get("hold_s", 0)))
        os._exit(0)
    os.close(w)
    return pid, r


def collect(pid: int, fd: int) -> dict:
    """The child's result; then it is killed (a holder) and reaped."""
    with os.fdopen(fd) as f:
        line = f.readline()
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return json.loads(line)


def plant(path: str, size: int, local_size: int, slot_bytes: int) -> dict:
    """The other user's segment: world-writable, of ``size`` bytes, with a valid header."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    os.fchmod(fd, 0o666)
    os.ftruncate(fd, size)
    header = b"".join(int(v).to_bytes(8, "little") for v in (MAGIC, VERSION, local_size))
    os.write(fd, header + int(slot_bytes).to_bytes(8, "little"))
    os.close(fd)
    return {"uid": os.stat(path).st_uid}
