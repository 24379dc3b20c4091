"""The shared-memory data plane against another local user, a hostile store client and
ranks that do not share ``/dev/shm`` (the handshake's other faults: test_shm_faults.py).

The other user is a child forked from a rank (or from this process) that drops to uid
and gid 65534 (``nobody``) before it acts (``_other_user``; needs root). The store is torch's TCPStore, which accepts any client: the tests
write its keys as an attacker would. Each attack checks that it reached the ranks (the
one warning names what the attacker planted), so a change of key names cannot turn it
into a test that passes without attacking.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
import uuid

import pytest
import torch
from _other_user import NOBODY, SHM, collect, fork_as, needs_root, plant
from _reliability import record

from ringcore.shm.files import Unusable, open_dir, open_segment
from ringcore.shm.group import ShmGroup
from ringcore.shm.segment import Layout, segment_name
from ringcore.testing import run_workers


def _uid() -> str:
    return uuid.uuid4().hex[:10]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        logging.getLogger("ringtrain").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def done(self) -> list[str]:
        logging.getLogger("ringtrain").removeHandler(self)
        return self.lines


def _mapped(path: str) -> list[str]:
    with open("/proc/self/maps") as f:
        return [line.strip() for line in f if path in line]


# ---- through init(): a planted segment, ranks without a common /dev/shm -------------------


def _client():
    """A new client of the job's store (torch's TCPStore admits anyone who reaches it)."""
    import torch.distributed as dist

    addr, port = os.environ["RING_STORE_ADDR"], int(os.environ["RING_STORE_PORT"])
    return dist.TCPStore(addr, port, is_master=False)


def _attack_store(prefix: str, token: str) -> None:
    """What any client of the job's store can do: name the segment before local rank 0
    does and count itself in (the keys ``join`` gives this ring's host 0)."""
    import torch.distributed as dist

    ring = dist.PrefixStore(prefix, _client())
    ring.set(f"{prefix}/h0/shm/name", token)
    ring.add(f"{prefix}/h0/shm/mapped", 1)


def _after_rank_1(prefix: str, free_space):
    """``free_space`` that first waits (<= 10 s) for local rank 1's outcome: local rank 0
    then publishes its name only after rank 1 has read the planted one."""

    def late(path: str) -> int:
        with contextlib.suppress(RuntimeError):
            key = f"{prefix}/{prefix}/h0/shm/ready/1"
            _client().wait([key], datetime.timedelta(seconds=10))
        return free_space(path)

    return late


def _one_init(prefix: str, case: str) -> dict:
    import ringcore.torch as hvd
    from ringcore.runtime import state as st
    from ringcore.shm.layer import ShmBackend

    rank = int(os.environ["RING_RANK"])
    layout = Layout(2, ShmBackend.slot_bytes)
    token = "0123456789abcdef"
    planted = os.path.join(SHM, segment_name(f"{prefix}/h0", token))
    saved_env, saved_dir, saved_free = dict(os.environ), ShmGroup.shm_dir, ShmGroup.free_space
    os.environ["RING_STORE_PREFIX"] = prefix
    if case == "unsigned":
        os.environ["RING_SECRET_KEY"] = ""  # a torchrun job: no secret
    if case != "apart" and rank == 0:
        collect(*fork_as(plant, planted, layout.size, 2, layout.slot_bytes))
        _attack_store(prefix, token)
        ShmGroup.free_space = staticmethod(_after_rank_1(prefix, ShmGroup.free_space))
    if case == "apart" and rank == 1:  # its own /dev/shm, as a container without --ipc=host
        ShmGroup.shm_dir = tempfile.mkdtemp(prefix="private-shm-")
    warnings = _Warnings()
    try:
        t0 = time.monotonic()
        hvd.init()
        init_s = time.monotonic() - t0
        mapped = _mapped(planted)  # while the ring (and any group) lives
        x = torch.tensor([42.0, 43.0]) if rank == 1 else torch.tensor([1.0, 1.0])
        total = hvd.allreduce(x, op=hvd.Sum).tolist()
        assert st.current is not None
        backend = type(st.current.engine.backend).__name__
        hvd.shutdown()
    finally:
        if ShmGroup.shm_dir != saved_dir:
            os.rmdir(ShmGroup.shm_dir)  # empty: nothing was created in it
        os.environ.clear()
        os.environ.update(saved_env)
        ShmGroup.shm_dir, ShmGroup.free_space = saved_dir, staticmethod(saved_free)
        if rank == 0:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(planted)
    return {
        "backend": backend,
        "sum": total,
        "init_s": init_s,
        "warnings": warnings.done(),
        "mapped": mapped,
        "planted": planted,
    }


def _init_cases_worker(base: str) -> dict:
    return {case: _one_init(f"{base}-{case}", case) for case in ("signed", "unsigned", "apart")}


@pytest.fixture(scope="module")
def init_cases():
    # a short timeout: a hang (the ranks split between two segments) fails in seconds
    env = {"RING_GLOO_TIMEOUT_SECONDS": "15"}
    return run_workers(_init_cases_worker, np=2, args=(f"sec{_uid()}",), env=env, timeout=240)


def _network_with_one_warning(results: list[dict], *says: str) -> str:
    assert [r["backend"] for r in results] == ["HostStaged", "HostStaged"], results
    assert all(r["sum"] == [43.0, 44.0] for r in results)
    assert all(r["mapped"] == [] for r in results)
    assert results[0]["warnings"] == []  # the lowest failing local rank says it, once
    (line,) = results[1]["warnings"]
    for s in says:
        assert s in line, line
    return line


@needs_root
@pytest.mark.reliability(
    fault="another local user plants the shared-memory segment and names it in the store",
    category="security",
)
def test_a_planted_segment_named_in_the_store_is_refused_by_its_signature(init_cases):
    results = [r["signed"] for r in init_cases]
    _network_with_one_warning(
        results, "not signed with the job's secret", results[0]["planted"], "network path"
    )


@needs_root
@pytest.mark.reliability(
    fault="another local user plants the shared-memory segment and names it in the store",
    category="security",
)
def test_without_a_secret_a_planted_segment_is_refused_because_another_user_owns_it(
    init_cases,
):
    results = [r["unsigned"] for r in init_cases]
    _network_with_one_warning(results, results[0]["planted"], f"owned by uid {NOBODY}")


@needs_root
@pytest.mark.reliability(
    fault="local ranks that share a host name but not /dev/shm (no --ipc=host)",
    category="fault",
)
def test_ranks_that_do_not_share_dev_shm_agree_on_the_network_within_seconds(request, init_cases):
    results = [r["apart"] for r in init_cases]
    _network_with_one_warning(results, "does not exist", "--ipc=host")
    slowest = max(r["init_s"] for r in results)
    assert slowest < 10.0, slowest  # the handshake's timeout is 15 s here
    record(request, detect_s=slowest)


# ---- the wake-up sockets: a squatter as another user, and as ours ----------------------------


_HELD: list[socket.socket] = []


def _squat(shm_dir: str, start: str, deadline_s: float) -> dict:
    """Wait for a segment named ``start*`` to appear, then try to take local rank 1's
    wake-up socket, by its abstract name (``\\0ringshm-<token>-1``, the old scheme)
    and in the group's folder, and to reach local rank 0's."""
    end = time.monotonic() + deadline_s
    seg = None
    while seg is None and time.monotonic() < end:
        found = [n for n in os.listdir(shm_dir) if n.startswith(start) and "." not in n]
        seg = found[0] if found else None
        time.sleep(0.002)
    if seg is None:
        return {"error": f"no {start}* appeared in {shm_dir}"}
    out: dict = {"hold_s": deadline_s, "segment": seg}
    folder = os.path.join(shm_dir, seg + ".d")
    for what, how in (
        ("abstract", lambda s: s.bind(f"\0ringshm-{seg.rsplit('-', 1)[1]}-1".encode())),
        ("bind", lambda s: s.bind(os.path.join(folder, "1"))),
        ("connect", lambda s: s.connect(os.path.join(folder, "0"))),
    ):
        while what != "abstract" and not os.path.lexists(folder) and time.monotonic() < end:
            time.sleep(0.002)
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            how(s)
            out[what] = "done"
            _HELD.append(s)  # held (not collected) until the child is killed
        except OSError as exc:
            out[what] = exc.strerror
    return out


def _squat_case(prefix: str, who: str) -> dict:
    import torch.distributed as dist

    rank = int(os.environ["RING_RANK"])
    start = segment_name(prefix, "")
    store = _client()
    squat: dict = {}
    if rank == 0:
        pid, fd = fork_as(_squat, SHM, start, 20.0, uid=NOBODY if who == "nobody" else None)

        def report() -> None:  # once the squatter has tried, local rank 1 may come
            with os.fdopen(fd) as f:
                squat.update(json.loads(f.readline()))
            _client().set(f"squatted/{prefix}", "1")  # a client of its own: one per thread

        reader = threading.Thread(target=report)
        reader.start()
    else:
        store.wait([f"squatted/{prefix}"], datetime.timedelta(seconds=30))
    warnings = _Warnings()
    t0 = time.monotonic()
    g = ShmGroup.create(dist.PrefixStore(prefix, store), prefix, rank, 2, timeout_s=8.0)
    took = time.monotonic() - t0
    total = None
    if g is not None:
        total = g.allreduce_(torch.ones(3) * (rank + 1)).tolist()
        g.close()
    if rank == 0:
        reader.join()
        os.kill(pid, signal.SIGKILL)  # it held its names until now
        os.waitpid(pid, 0)
    return {
        "group": g is not None,
        "sum": total,
        "took_s": took,
        "warnings": warnings.done(),
        "squat": squat or None,
        "left": [n for n in os.listdir(SHM) if n.startswith(start)],
    }


def _squat_worker(base: str) -> dict:
    return {who: _squat_case(f"{base}-{who}", who) for who in ("nobody", "us")}


@pytest.fixture(scope="module")
def squats():
    return run_workers(_squat_worker, np=2, args=(f"sq{_uid()}",), timeout=120)


@needs_root
@pytest.mark.reliability(
    fault="another local user squats a wake-up socket name", category="security"
)
def test_another_user_can_neither_take_nor_reach_the_wake_up_sockets(squats):
    results = [r["nobody"] for r in squats]
    squat = results[0]["squat"]
    assert "segment" in squat, squat  # it found the group's segment and tried
    assert squat["bind"] == squat["connect"] == "Permission denied", squat
    assert [r["group"] for r in results] == [True, True], results
    assert all(r["sum"] == [3.0, 3.0, 3.0] for r in results)
    assert all(r["warnings"] == [] and r["left"] == [] for r in results), results


@needs_root
@pytest.mark.reliability(
    fault="a wake-up socket's name is taken before its rank binds it", category="security"
)
def test_a_taken_wake_up_socket_is_detected_at_once_and_the_ranks_use_the_network(request, squats):
    results = [r["us"] for r in squats]
    assert results[0]["squat"]["bind"] == "done", results[0]["squat"]
    assert [r["group"] for r in results] == [False, False], results
    assert results[0]["warnings"] == []
    (line,) = results[1]["warnings"]
    assert "is taken" in line and f"{results[0]['squat']['segment']}.d/1" in line, line
    assert max(r["took_s"] for r in results) < 4.0, results  # not the 8 s timeout
    assert all(r["left"] == [] for r in results), results
    record(request, detect_s=max(r["took_s"] for r in results))


# ---- the checks themselves ------------------------------------------------------------------


def _foreign_file(folder: str, name: str, size: int) -> dict:
    fd = os.open(os.path.join(folder, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.ftruncate(fd, size)
    os.close(fd)
    os.mkdir(os.path.join(folder, name + ".d"), 0o700)
    return {}


@needs_root
@pytest.mark.reliability(
    fault="a shared-memory name that is not ours, not private, or not a file",
    category="security",
    cases=11,
)
def test_a_segment_or_folder_is_refused_unless_ours_private_and_plain():
    size = Layout(2, 4096).size
    folder = tempfile.mkdtemp(prefix="shmcheck-", dir=SHM)
    os.chmod(folder, 0o1777)  # world-writable and sticky, as /dev/shm
    try:
        collect(*fork_as(_foreign_file, folder, "foreign", size))

        def make(name: str, mode: int = 0o600, nbytes: int = size) -> str:
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT, mode)
            os.fchmod(fd, mode)
            os.ftruncate(fd, nbytes)
            os.close(fd)
            return path

        good = make("good")
        os.symlink(good, os.path.join(folder, "symlink"))
        os.link(make("linked"), os.path.join(folder, "linked2"))
        os.mkfifo(os.path.join(folder, "fifo"), 0o600)
        os.mkdir(os.path.join(folder, "folder"), 0o700)
        os.mkdir(os.path.join(folder, "open.d"), 0o755)
        make("open", 0o644)
        make("small", nbytes=4096)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        refused = {
            "foreign": f"owned by uid {NOBODY}",
            "open": "lets other users in",
            "symlink": "symbolic link",
            "linked": "2 links",
            "fifo": "not a regular file",
            "folder": "is a directory",
            "small": "holds 4096 bytes",
            "missing": "does not exist",
        }
        for name, says in refused.items():
            with pytest.raises(Unusable, match=says):
                os.close(open_segment(fd, folder, name, size))
        os.close(open_segment(fd, folder, "good", size))
        with pytest.raises(Unusable, match=f"owned by uid {NOBODY}"):
            open_dir(fd, folder, "foreign.d")
        with pytest.raises(Unusable, match="lets other users in"):
            open_dir(fd, folder, "open.d")
        with pytest.raises(Unusable, match="not a directory"):
            open_dir(fd, folder, "good")
        os.close(fd)
    finally:
        shutil.rmtree(folder)
