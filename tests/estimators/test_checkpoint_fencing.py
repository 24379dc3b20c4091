"""A run's checkpoints against zombie writers, killed writers and a failing store, through
the Store API (``claim_run``, ``write_checkpoint``, ``find_checkpoint``) on a LocalStore
(in place, under the run's lock) and on FsspecStores (one folder per writer): memory://,
a real S3 API (moto on 127.0.0.1) and file:// across processes.

A zombie is an attempt Spark gave up on whose process still runs: it may be anywhere
inside a write when the retried attempt claims the run. The writes here pause inside
their ``write`` callback (the seam every checkpoint goes through) to land each
interleaving without a timing guess."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import re
import signal
import subprocess
import sys
import threading
import time
import uuid

import fsspec
import pytest
import torch
from _reliability import record
from fsspec.implementations.local import LocalFileSystem

from estimators import FsspecStore, Store
from estimators.store import ClaimUnreadableError, StaleWriterError

ZOMBIE, RETRY, LATER_FIT = (100, 0), (100, 1), (200, 0)
BUCKET = "ringtrain-fencing"


@pytest.fixture(scope="module")
def s3_options():
    pytest.importorskip("moto")
    import s3fs
    from _servers import moto_s3_server

    with moto_s3_server() as options:
        s3fs.S3FileSystem(**options).mkdir(BUCKET)
        yield options


@pytest.fixture(params=["local", "memory", "s3"])
def store(request, tmp_path):
    if request.param == "local":
        yield Store.create(str(tmp_path / "store"))
        return
    if request.param == "memory":
        url = f"memory://fencing-{uuid.uuid4().hex[:8]}"
        options = {}
    else:
        url, options = (
            f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}",
            request.getfixturevalue("s3_options"),
        )
    store = Store.create(url, options)
    yield store
    store.rm(store.prefix_path)


def _files(store: Store, run_id: str) -> list[str]:
    root = store.get_run_path(run_id)
    if isinstance(store, FsspecStore):
        store.fs.invalidate_cache()
        return sorted(store.fs.find(root))
    return sorted(os.path.join(d, f) for d, _, names in os.walk(root) for f in names)


def _write(data: bytes):
    return lambda f: f.write(data)


class _Paused:
    """A ``write`` callback that writes half its bytes, says so, and waits to be let go."""

    def __init__(self, data: bytes):
        self.data, self.inside, self.go = data, threading.Event(), threading.Event()

    def __call__(self, f) -> None:
        half = len(self.data) // 2
        f.write(self.data[:half])
        self.inside.set()
        assert self.go.wait(30), "never let go"
        f.write(self.data[half:])


class _Writing(threading.Thread):
    """``store.write_checkpoint(run_id, writer, write)`` on a thread; ``error`` after."""

    def __init__(self, store: Store, writer, write: _Paused):
        super().__init__(daemon=True)
        self.store, self.writer, self.write = store, writer, write
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.store.write_checkpoint("r", self.writer, self.write)
        except BaseException as exc:
            self.error = exc

    def paused(self) -> _Writing:
        self.start()
        assert self.write.inside.wait(30), "the write never started"
        return self


ORDERS = ["zombie-commits-after-the-retry-wrote", "zombie-commits-while-the-retry-writes"]


@pytest.mark.reliability(
    fault="a zombie task attempt writing the run's checkpoint after a retry took over",
    category="fault",
)
@pytest.mark.parametrize("order", ORDERS)
def test_a_zombie_paused_inside_its_write_never_replaces_or_loses_the_retrys_checkpoints(
    store, order
):
    store.claim_run("r", ZOMBIE)
    for epoch in (1, 2):
        store.write_checkpoint("r", ZOMBIE, _write(b"attempt 0, epoch %d" % epoch))
    zombie = _Writing(store, ZOMBIE, _Paused(b"zombie, epoch 3" * 1000)).paused()
    store.claim_run("r", RETRY)  # Spark retried the stage: attempt 1 resumes from epoch 2
    assert store.read_bytes(store.find_checkpoint("r")) == b"attempt 0, epoch 2"
    if order == ORDERS[0]:
        store.write_checkpoint("r", RETRY, _write(b"attempt 1, epoch 3"))
        zombie.write.go.set()
        zombie.join(30)
    else:
        retry = _Writing(store, RETRY, _Paused(b"attempt 1, epoch 3")).paused()
        zombie.write.go.set()
        zombie.join(30)
        retry.write.go.set()
        retry.join(30)
        assert retry.error is None, repr(retry.error)  # its temporary file was its own
    assert isinstance(zombie.error, StaleWriterError), repr(zombie.error)
    latest = store.find_checkpoint("r")  # what the next resume reads: the retry's
    assert store.read_bytes(latest) == b"attempt 1, epoch 3"
    assert store.read_bytes(latest + ".prev") == b"attempt 0, epoch 2"  # the one before, kept
    assert not [f for f in _files(store, "r") if ".tmp-" in f]
    store.write_checkpoint("r", RETRY, _write(b"attempt 1, epoch 4"))
    assert store.read_bytes(store.find_checkpoint("r")) == b"attempt 1, epoch 4"
    assert not [f for f in _files(store, "r") if b"zombie" in store.read_bytes(f)]


def test_a_writer_older_than_the_runs_claim_is_refused_and_writes_nothing(store):
    store.claim_run("r", ZOMBIE)
    store.write_checkpoint("r", ZOMBIE, _write(b"attempt 0"))
    store.claim_run("r", RETRY)  # the retried stage
    with pytest.raises(StaleWriterError, match=r"stage attempt 0\) would write a checkpoint"):
        store.write_checkpoint("r", ZOMBIE, _write(b"zombie"))
    assert store.read_bytes(store.find_checkpoint("r")) == b"attempt 0"
    store.write_checkpoint("r", RETRY, _write(b"attempt 1"))
    store.claim_run("r", LATER_FIT)  # a later fit of the same run_id resumes it
    for stale in [(100, 1), (100, 5)]:
        with pytest.raises(StaleWriterError, match=r"a newer attempt \(fit 200, stage attempt 0\)"):
            store.write_checkpoint("r", stale, _write(b"zombie"))
        with pytest.raises(StaleWriterError):
            store.claim_run("r", stale)
    assert store.read_bytes(store.find_checkpoint("r")) == b"attempt 1"


def test_attempt_numbers_below_zero_order_writers_as_any_other(store):
    # what spark_runner hands out when no rank reached the driver: below every number
    # the driver gives, larger for each later attempt
    first, retry = (7, -(2**62) + 10), (7, -(2**62) + 25)
    store.claim_run("r", first)
    store.write_checkpoint("r", first, _write(b"first"))
    store.claim_run("r", retry)
    with pytest.raises(StaleWriterError):
        store.write_checkpoint("r", first, _write(b"zombie"))
    store.write_checkpoint("r", retry, _write(b"retry"))
    assert store.read_bytes(store.find_checkpoint("r")) == b"retry"
    store.claim_run("r", (7, 0))  # an attempt the driver numbered: newer than both
    assert store.read_bytes(store.find_checkpoint("r")) == b"retry"


def test_a_torn_claim_claims_nothing(tmp_path):
    store = Store.create(str(tmp_path))
    store.claim_run("r", LATER_FIT)
    store.write_bytes(store.get_writer_path("r"), b'{"fit": 2')  # torn by a crash
    store.write_checkpoint("r", (1, 0), _write(b"after a torn claim"))
    assert store.read_bytes(store.find_checkpoint("r")) == b"after a torn claim"


# --- a claim that cannot be read: fail closed -----------------------------------------------


class _FlakyFileSystem(LocalFileSystem):
    """The local filesystem, except that the next ``failures`` reads of a run's claim
    (listing a checkpoint folder, opening a claim file) raise EIO: a store failing."""

    protocol = ("flakyfile",)
    failures = 0

    def _fail(self, path: str) -> None:
        if type(self).failures > 0:
            type(self).failures -= 1
            raise OSError(errno.EIO, "Input/output error (injected)", path)

    def ls(self, path, detail=False, **kwargs):
        if "/checkpoint" in str(path):
            self._fail(path)
        return super().ls(path, detail=detail, **kwargs)

    def _open(self, path, mode="rb", **kwargs):
        if "r" in mode and os.path.basename(str(path)) in ("writer.json", "claim.json"):
            self._fail(path)
        return super()._open(path, mode=mode, **kwargs)


@pytest.fixture
def flaky_store(tmp_path):
    fsspec.register_implementation("flakyfile", _FlakyFileSystem, clobber=True)
    store = Store.create(f"flakyfile://{tmp_path}/store")
    store.claim_run("r", ZOMBIE)
    store.write_checkpoint("r", ZOMBIE, _write(b"attempt 0"))
    store.claim_run("r", RETRY)
    store.write_checkpoint("r", RETRY, _write(b"attempt 1"))
    yield store
    _FlakyFileSystem.failures = 0


@pytest.mark.reliability(
    fault="the store failing while a write reads the run's claim (fail closed)",
    category="fault",
)
def test_a_transient_store_error_reading_the_claim_is_retried_and_still_refuses_a_zombie(
    flaky_store,
):
    _FlakyFileSystem.failures = 1
    with pytest.raises(StaleWriterError):
        flaky_store.write_checkpoint("r", ZOMBIE, _write(b"zombie"))
    assert _FlakyFileSystem.failures == 0  # the error was met, and retried past
    assert flaky_store.read_bytes(flaky_store.find_checkpoint("r")) == b"attempt 1"


@pytest.mark.reliability(
    fault="the store failing while a write reads the run's claim (fail closed)",
    category="fault",
)
def test_a_claim_the_store_keeps_failing_to_read_refuses_the_write_naming_it(flaky_store):
    _FlakyFileSystem.failures = 100
    started = time.monotonic()
    with pytest.raises(ClaimUnreadableError) as info:
        flaky_store.write_checkpoint("r", RETRY, _write(b"unfenced"))
    waited = time.monotonic() - started
    message = str(info.value)
    for needle in (
        "run 'r'",  # the thing, where, what the store said, and the fix
        f"at {flaky_store.get_checkpoints_path('r')} could not be read in 4 tries",
        "OSError: [Errno 5] Input/output error (injected)",
        "Check that the store is reachable and readable",
        "fit again with the same run_id",
    ):
        assert needle in message, message
    _FlakyFileSystem.failures = 0
    assert flaky_store.read_bytes(flaky_store.find_checkpoint("r")) == b"attempt 1"
    assert waited < 5


def test_an_unreadable_claim_on_a_local_store_refuses_the_write(tmp_path):
    store = Store.create(str(tmp_path))
    store.claim_run("r", RETRY)
    store.write_checkpoint("r", RETRY, _write(b"attempt 1"))
    claim = store.get_writer_path("r")
    os.remove(claim)
    os.mkdir(claim)  # reading it raises IsADirectoryError, every time
    with pytest.raises(ClaimUnreadableError, match=re.escape(f"at {claim} could not be read")):
        store.write_checkpoint("r", ZOMBIE, _write(b"zombie"))
    assert store.read_bytes(store.find_checkpoint("r")) == b"attempt 1"


# --- a run of the layout before per-writer folders --------------------------------------------


def test_an_object_store_run_written_in_place_is_resumed_then_migrated(tmp_path):
    store = Store.create(f"memory://fencing-{uuid.uuid4().hex[:8]}")
    try:
        in_place = store.get_checkpoint_path("r")  # what the previous version wrote
        store.write_atomic(in_place, _write(b"epoch 1"))
        store.write_atomic(in_place, _write(b"epoch 2"))
        store.write_json(store.get_writer_path("r"), {"fit": 1, "attempt": 0})
        assert store.find_checkpoint("r") == in_place
        store.claim_run("r", RETRY)
        resumed = store.find_checkpoint("r")
        assert resumed != in_place and store.read_bytes(resumed) == b"epoch 2"
        store.write_checkpoint("r", RETRY, _write(b"epoch 3"))
        assert store.read_bytes(store.find_checkpoint("r") + ".prev") == b"epoch 2"
        assert [f for f in _files(store, "r") if "/writer-" not in f] == []
    finally:
        store.rm(store.prefix_path)


# --- a writer SIGKILLed mid-write ------------------------------------------------------------

_KILLED_WRITER = """
import os, sys, time, torch
from estimators import FsspecStore, Store

url, marks = sys.argv[1], sys.argv[2]

class Halfway:  # writes through to the file; past half of it, says so and waits
    def __init__(self, f): self.f, self.written = f, 0
    def write(self, data):
        n = self.f.write(data); self.written += n
        if self.written > 16 << 20 and not os.path.exists(marks):
            self.f.flush(); open(marks, "w").close(); time.sleep(120)
        return n
    def flush(self): self.f.flush()

state = {"epoch": 3, "w": torch.full((8 << 20,), 3.0)}  # 32 MiB
store = FsspecStore(url) if url.startswith("file://") else Store.create(url)
store.write_checkpoint("r", (1, 0), lambda f: torch.save(state, Halfway(f)))
"""


def _epoch_of(store: Store, path: str) -> int:
    return int(torch.load(io.BytesIO(store.read_bytes(path)), weights_only=True)["epoch"])


def _save(epoch: int):
    return lambda f: torch.save({"epoch": epoch, "w": torch.full((64,), float(epoch))}, f)


@pytest.mark.reliability(fault="a checkpoint writer SIGKILLed mid-write", category="fault")
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["local", "fsspec-file"])
def test_a_writer_killed_mid_write_leaves_the_last_checkpoint_whole_and_the_next_resumes(
    kind, tmp_path, request
):
    url = str(tmp_path / "store") if kind == "local" else f"file://{tmp_path}/store"
    store = Store.create(url) if kind == "local" else FsspecStore(url)
    store.claim_run("r", (1, 0))
    for epoch in (1, 2):
        store.write_checkpoint("r", (1, 0), _save(epoch))
    latest = store.find_checkpoint("r")
    marks = str(tmp_path / "halfway")
    writer = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, url, marks])
    try:
        deadline = time.monotonic() + 90
        while not os.path.exists(marks):
            assert writer.poll() is None and time.monotonic() < deadline, "never got halfway"
            time.sleep(0.02)
        killed = time.monotonic()
        writer.send_signal(signal.SIGKILL)
        writer.wait(30)
    finally:
        with contextlib.suppress(ProcessLookupError):
            writer.kill()
    temps = [f for f in _files(store, "r") if ".tmp-" in f]
    assert len(temps) == 1 and os.path.getsize(temps[0]) > 16 << 20  # killed mid-write
    # the newest checkpoint is whole where it was, and the one before it too
    assert store.find_checkpoint("r") == latest and _epoch_of(store, latest) == 2
    assert _epoch_of(store, latest + ".prev") == 1
    # the next attempt resumes from epoch 2, and its first checkpoint clears the debris
    store.claim_run("r", (1, 1))
    assert _epoch_of(store, store.find_checkpoint("r")) == 2
    store.write_checkpoint("r", (1, 1), _save(3))
    found = store.find_checkpoint("r")
    assert _epoch_of(store, found) == 3 and _epoch_of(store, found + ".prev") == 2
    assert [f for f in _files(store, "r") if ".tmp-" in f] == []
    record(request, recover_s=time.monotonic() - killed)


def test_a_keras_checkpoint_carries_its_history_so_a_resume_from_the_previous_knows_its_epochs():
    import zipfile

    from estimators.frameworks.keras._checkpoint import history_in, with_history

    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:  # a .keras file is a zip archive
        archive.writestr("config.json", "{}")
    keras_file = buffer.getvalue()
    assert history_in(keras_file) is None  # one an earlier ringtrain wrote: history.json
    history = [{"epoch": 1, "train_loss": 0.5}]
    data = with_history(keras_file, history)
    assert history_in(data) == history
    assert zipfile.ZipFile(io.BytesIO(data)).read("config.json") == b"{}"
