"""Fits preparing data in one store at once each claim their own data index, and a failed
preparation removes only its own."""

from __future__ import annotations

import os
import threading

import pytest

from estimators import Store


def _race(store: Store, n: int) -> list[int]:
    start, got = threading.Barrier(n), []
    lock = threading.Lock()

    def claim() -> None:
        start.wait()
        idx = store.next_data_index()
        with lock:
            got.append(idx)

    threads = [threading.Thread(target=claim) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


@pytest.mark.reliability(
    fault="two fits preparing data in one store at once", category="fault", cases=2
)
@pytest.mark.parametrize("kind", ["local", "memory"])
def test_fits_racing_on_one_store_each_claim_their_own_data_index(kind, tmp_path, memory_store):
    store = Store.create(str(tmp_path)) if kind == "local" else memory_store
    if kind == "local":
        os.makedirs(str(tmp_path / "intermediate_train_data.0"))
    got = _race(store, 8)
    assert len(got) == 8 and len(set(got)) == 8, f"indexes handed out twice: {sorted(got)}"
    if kind == "local":
        assert 0 not in got  # data already there (an older fit's) is not claimed
    for idx in got:
        assert store.exists(store.get_data_claim_path(idx))


@pytest.mark.reliability(fault="two fits preparing data in one store at once", category="fault")
def test_a_failed_preparation_removes_its_own_index_only(tmp_path):
    store = Store.create(str(tmp_path))
    theirs, ours = store.next_data_index(), store.next_data_index()
    assert theirs != ours
    for idx in (theirs, ours):  # both fits wrote (part of) their Parquet
        os.makedirs(store.get_train_data_path(idx))
        os.makedirs(store.get_val_data_path(idx))
    store.release_data_index(ours)  # what prepare_data does when its write fails
    assert store.exists(store.get_train_data_path(theirs))
    assert store.exists(store.get_val_data_path(theirs))
    assert not store.exists(store.get_train_data_path(ours))
    assert not store.exists(store.get_data_claim_path(ours))
    assert store.next_data_index() == ours  # free again
