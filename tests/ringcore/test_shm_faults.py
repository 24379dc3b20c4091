"""Faults of the shared-memory handshake and its wake-ups: a creator SIGKILLed before the
other ranks opened its segment (its names stay until the next group on the host sweeps
them), a local rank that never arrives, and a stream of wake-up datagrams.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest
from _other_user import SHM, collect, fork_as, needs_root, plant
from _reliability import record

from ringcore import RingError
from ringcore.shm.group import ShmGroup
from ringcore.shm.segment import segment_name
from ringcore.shm.sync import PID, Sync


def _uid() -> str:
    return uuid.uuid4().hex[:10]


# ---- a stream of wake-ups -----------------------------------------------------------------


class _Stream:
    """A wake-up socket that never runs dry, as under a steady stream of datagrams (the
    socket is the ``Sync``'s argument: our own seam)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def fileno(self) -> int:
        return self.sock.fileno()

    def recv(self, n: int) -> bytes:
        return b"\0"

    def close(self) -> None:
        self.sock.close()


@pytest.mark.reliability(
    fault="a steady stream of wake-up datagrams to a waiting rank", category="load"
)
@pytest.mark.timeout(30)
def test_a_stream_of_wake_ups_cannot_keep_a_waiter_past_its_timeout(request):
    mine, peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
    peer.send(b"\0")  # readable: poll returns at once, as under a stream
    ctrl = memoryview(bytearray(2 * 64)).cast("q")
    ctrl[8 + PID] = os.getpid()  # the peer (alive) never posts
    sync = Sync(ctrl, 0, 2, _Stream(mine), {1: peer})  # type: ignore[arg-type]
    t0 = time.monotonic()
    with pytest.raises(RingError, match="timed out after"):
        sync.barrier("barrier", 0.5)
    waited = time.monotonic() - t0
    sync.close()
    assert waited < 2.0, waited
    record(request, detect_s=waited)


# ---- leftovers of a creator killed in the handshake --------------------------------------------


_CREATOR = """
import sys
from torch.distributed import HashStore
from ringcore.shm.group import ShmGroup
ShmGroup.create(HashStore(), sys.argv[1], 0, 2, timeout_s=60.0)  # waits for local rank 1
"""


def _wait_for(paths: list[str], timeout_s: float = 30.0) -> None:
    end = time.monotonic() + timeout_s
    while not all(os.path.lexists(p) for p in paths):
        assert time.monotonic() < end, f"{paths} did not appear"
        time.sleep(0.02)


def _sweep_by_forming_a_group() -> None:
    from torch.distributed import HashStore

    g = ShmGroup.create(HashStore(), f"sweeper{_uid()}", 0, 1, timeout_s=5.0)
    assert g is not None
    g.close()


def _age(paths: list[str], seconds: float) -> None:
    then = time.time() - seconds
    for p in paths:
        os.utime(p, (then, then), follow_symlinks=False)


@needs_root
@pytest.mark.reliability(
    fault="local rank 0 SIGKILLed during the shared-memory handshake", category="fault"
)
@pytest.mark.timeout(90)
def test_a_creator_killed_in_the_handshake_leaves_names_the_next_group_sweeps():
    prefix = f"dead{_uid()}"
    start = segment_name(prefix, "")
    creator = subprocess.Popen([sys.executable, "-c", _CREATOR, prefix])
    foreign = os.path.join(SHM, segment_name(f"foreign{_uid()}", "0123456789abcdef"))
    try:
        end = time.monotonic() + 30
        names: list[str] = []
        while not names:
            assert time.monotonic() < end and creator.poll() is None, "no segment appeared"
            names = [n for n in os.listdir(SHM) if n.startswith(start)]
            time.sleep(0.02)
        seg = os.path.join(SHM, sorted(names)[0].removesuffix(".d"))
        _wait_for([seg + ".d/0"])  # rank 0 bound its socket: it waits for rank 1
        left = [seg, seg + ".d"]
        collect(*fork_as(plant, foreign, 4096, 2, 4096))
        _age([*left, foreign], 600)  # long unchanged: only a lock tells them apart
        _sweep_by_forming_a_group()
        assert all(os.path.lexists(p) for p in [*left, foreign])  # alive / not ours
        _age(left, 0)  # young again: no other sweeper on this host takes them early
        creator.send_signal(signal.SIGKILL)
        creator.wait(10)
        assert all(os.path.lexists(p) for p in left)  # what the kill leaves
        _age(left, 600)
        _sweep_by_forming_a_group()
        assert [p for p in left if os.path.lexists(p)] == []
        assert os.path.lexists(foreign)  # another user's: never touched
    finally:
        creator.kill()
        creator.wait(10)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(foreign)


# ---- a local rank that never arrives --------------------------------------------------------


def test_a_missing_local_rank_times_out_naming_it_and_leaves_no_names():
    from torch.distributed import HashStore

    prefix = f"alone{_uid()}"
    with pytest.raises(RingError, match=r"timed out after 1 s .*ready/1"):
        ShmGroup.create(HashStore(), prefix, 0, 2, timeout_s=1.0)
    assert [n for n in os.listdir(SHM) if n.startswith(segment_name(prefix, ""))] == []
