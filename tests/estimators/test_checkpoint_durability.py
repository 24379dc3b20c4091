"""The checkpoints survive a crash: fsynced before they replace the last one, a damaged or
empty newest one falls back to the previous one, a killed Ray copy is removed."""

from __future__ import annotations

import io
import logging
import os

import pytest
import torch

from estimators import FsspecStore, Store


def _save(store: Store, path: str, epoch: int) -> None:
    state = {"model": {"w": torch.full((64,), float(epoch))}, "epoch": epoch}
    store.write_atomic(path, lambda f: torch.save(state, f))


def _epoch(store: Store, path: str) -> int:
    return int(torch.load(io.BytesIO(store.read_bytes(path)), weights_only=True)["epoch"])


def _damage(store: Store, path: str, how: str) -> None:
    data = store.read_bytes(path)
    if how == "empty":
        data = b""
    elif how == "truncated":
        data = data[: len(data) // 2]
    else:  # a flipped byte inside the tensor data
        i = data.index(b"\x00\x00\x00@" * 8)  # the weights of epoch 2: 2.0 as float32
        data = data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1 :]
    if isinstance(store, FsspecStore):
        store.fs.pipe_file(path, data)
    else:
        with open(path, "wb") as f:
            f.write(data)


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
@pytest.mark.parametrize("how", ["empty", "truncated", "corrupt"])
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(
    kind, how, tmp_path, memory_store, caplog
):
    store = Store.create(str(tmp_path)) if kind == "local" else memory_store
    path = store.get_checkpoint_path("r1")
    _save(store, path, 1)
    _save(store, path, 2)
    assert store.find_checkpoint("r1") == path and _epoch(store, path) == 2
    _damage(store, path, how)
    with caplog.at_level(logging.WARNING, logger="ringtrain.estimators"):
        found = store.find_checkpoint("r1")
    assert found == path + ".prev" and _epoch(store, found) == 1
    assert f"the checkpoint {path} is damaged" in caplog.text


class _FsyncSpy:
    """Records, in order, the paths os.fsync was called on and the os.replace / os.rename
    calls (each still runs: the real filesystem is used)."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, str]] = []
        real_fsync, real_replace, real_rename = os.fsync, os.replace, os.rename

        def fsync(fd):
            self.events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
            return real_fsync(fd)

        def replace(src, dst, **kw):
            self.events.append(("move", f"{src} -> {dst}"))
            return real_replace(src, dst, **kw)

        def rename(src, dst, **kw):
            self.events.append(("move", f"{src} -> {dst}"))
            return real_rename(src, dst, **kw)

        monkeypatch.setattr(os, "fsync", fsync)
        monkeypatch.setattr(os, "replace", replace)
        monkeypatch.setattr(os, "rename", rename)

    def index(self, kind: str, contains: str) -> int:
        for i, (k, what) in enumerate(self.events):
            if k == kind and contains in what:
                return i
        raise AssertionError(f"no {kind} of {contains!r} in {self.events}")


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
def test_a_local_checkpoint_is_fsynced_before_it_replaces_the_last_one(tmp_path, monkeypatch):
    store = Store.create(str(tmp_path))
    path = store.get_checkpoint_path("r1")
    _save(store, path, 1)
    spy = _FsyncSpy(monkeypatch)
    _save(store, path, 2)
    tmp_fsync = spy.index("fsync", f"{path}.tmp-")
    keep = spy.index("move", f"{path} -> {path}.prev")
    install = spy.index("move", ".tmp-")
    folder_fsync = max(
        i for i, (k, w) in enumerate(spy.events) if k == "fsync" and w == os.path.dirname(path)
    )
    assert tmp_fsync < keep < install < folder_fsync, spy.events
    assert _epoch(store, path) == 2 and _epoch(store, path + ".prev") == 1


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
def test_an_empty_checkpoint_after_a_crash_resumes_from_the_previous_one_not_refused(tmp_path):
    from estimators.frameworks.torch._checkpoint import check_resume

    store = Store.create(str(tmp_path))
    model = torch.nn.Linear(64, 1)
    path = store.get_checkpoint_path("crashed")
    for epoch in (1, 2):
        state = {"model": model.state_dict(), "optimizer": {}, "epoch": epoch, "history": []}
        store.write_atomic(path, lambda f, s=state: torch.save(s, f))
    open(path, "wb").close()  # what a host crash before the data reached the disk leaves
    # the driver's check: no ValueError, it resumes
    check_resume(model, store, "crashed", store.find_checkpoint("crashed"))
    found = store.find_checkpoint("crashed")
    assert found == path + ".prev"
    assert torch.load(found, weights_only=True)["epoch"] == 1


@pytest.mark.reliability(
    fault="a host crash leaving the newest checkpoint empty, truncated or corrupt",
    category="fault",
)
def test_a_ray_checkpoint_is_fsynced_before_its_commit_and_killed_copies_are_removed(
    tmp_path, monkeypatch
):
    from ray_runner import Checkpoint
    from ray_runner._checkpoint import CheckpointStore

    source = tmp_path / "src"
    (source / "sub").mkdir(parents=True)
    (source / "model.pt").write_bytes(b"weights")
    (source / "sub" / "opt.pt").write_bytes(b"state")
    run = tmp_path / "run"
    killed = run / "checkpoint_000000"  # an upload SIGKILLed half-way: no commit record
    killed.mkdir(parents=True)
    (killed / "model.pt").write_bytes(b"")
    store = CheckpointStore(str(run), num_to_keep=1)
    assert store.latest() is None  # never resumed from
    store.remove_uncommitted()  # what the driver does before the next attempt
    assert not killed.exists()
    spy = _FsyncSpy(monkeypatch)
    got = store.persist(Checkpoint.from_directory(source))
    records = str(run / ".ringtrain")
    commit = spy.index("move", f"{records}/checkpoint_")  # the record: write, fsync, rename
    assert spy.index("fsync", "/model.pt") < commit and spy.index("fsync", "/sub/opt.pt") < commit
    assert spy.index("fsync", f"{records}/checkpoint_") < commit
    assert max(i for i, (k, w) in enumerate(spy.events) if k == "fsync" and w == records) > commit
    assert sorted(os.listdir(run)) == [".ringtrain", os.path.basename(got.path)]
    assert (run / os.path.basename(got.path) / "sub" / "opt.pt").read_bytes() == b"state"
    assert store.latest() is not None and store.latest().path == got.path
