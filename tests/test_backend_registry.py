"""The backend registry: ``RING_BACKEND`` names a registered factory, nothing else."""

from __future__ import annotations

import pytest

from ringcore import _backends
from ringcore._backends import (
    Connection,
    lookup_backend,
    register_backend,
    registered_backends,
)
from ringcore.testing import run_workers


@pytest.fixture
def registry(monkeypatch):
    """A copy of the registry, so a test's registrations end with the test."""
    monkeypatch.setattr(_backends, "_REGISTRY", dict(_backends._REGISTRY))


def test_gloo_nccl_and_mpi_are_registered():
    assert {"gloo", "nccl", "mpi"} <= set(registered_backends())


def test_an_unknown_backend_name_lists_the_registered_ones():
    with pytest.raises(ValueError) as info:
        lookup_backend("ucx")
    msg = str(info.value)
    assert "RING_BACKEND='ucx' is not a backend" in msg
    assert ", ".join(registered_backends()) in msg and "register_backend" in msg


def test_a_registered_backend_is_looked_up_by_its_name(registry):
    def factory(rdv):
        raise AssertionError("not called by a lookup")

    register_backend("shm", factory)
    assert lookup_backend("shm") is factory
    assert "shm" in registered_backends()
    with pytest.raises(ValueError, match="lower case"):
        register_backend("Shm", factory)


class _Counting:
    """A test backend: the job's Gloo ring, counting the collectives it is asked for."""

    name = "counting"

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def __getattr__(self, attr):
        method = getattr(self.inner, attr)

        def counted(*args, **kwargs):
            self.calls.append(attr)
            return method(*args, **kwargs)

        return counted


def _counting_worker() -> dict:
    import torch

    import ringcore
    import ringcore.torch as hvd
    from ringcore import _backends

    closed = []

    def factory(rdv):
        gloo = _backends.lookup_backend("gloo")(rdv)

        def close():
            closed.append(True)
            if gloo.close is not None:
                gloo.close()

        return Connection(_Counting(gloo.backend), gloo.rendezvous, gloo.store, close)

    _backends.register_backend("counting", factory)
    hvd.init()
    try:
        backend = ringcore._runtime.engine().backend
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
        facts = {"name": ringcore._runtime.backend_name(), "sum": total, "calls": backend.calls}
    finally:
        hvd.shutdown()
    facts["closed"] = closed
    return facts


def test_init_picks_the_backend_ring_backend_names():
    facts = run_workers(_counting_worker, np=2, env={"RING_BACKEND": "counting"})
    for f in facts:
        assert f["name"] == "counting" and f["sum"] == 3.0
        assert f["calls"][0] == "broadcast_object" and "allreduce" in f["calls"]
        assert f["closed"] == [True]


def _unknown_backend_worker() -> str:
    import ringcore

    try:
        ringcore.init()
    except ValueError as exc:
        return str(exc)
    ringcore.shutdown()
    return "init() accepted it"


def test_init_with_an_unknown_backend_names_the_registered_ones():
    (msg,) = run_workers(_unknown_backend_worker, np=1, env={"RING_BACKEND": "ucx"})
    assert "RING_BACKEND='ucx' is not a backend; use one of gloo, mpi, nccl" in msg
