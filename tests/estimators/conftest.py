"""Fixtures the estimator tests share."""

from __future__ import annotations

import uuid

import pytest

from estimators import Store


@pytest.fixture
def memory_store():
    """A store on fsspec's in-memory file system, its files removed after the test."""
    store = Store.create(f"memory://ringtrain-test-{uuid.uuid4().hex[:8]}")
    yield store
    store.rm(store.prefix_path)
