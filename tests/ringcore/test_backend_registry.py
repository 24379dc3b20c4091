"""The backend registry: ``RING_BACKEND`` names a registered factory, nothing else."""

from __future__ import annotations

import pytest

from ringcore.backends import registry as _backends
from ringcore.backends.registry import lookup_backend, registered_backends
from ringcore.launch import register_backend
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
    import dataclasses

    import torch

    import ringcore.torch as hvd
    from ringcore.backends.registry import lookup_backend
    from ringcore.launch import backend_name, data_plane, register_backend
    from ringcore.runtime.state import engine

    closed = []

    def factory(rdv):
        gloo = lookup_backend("gloo")(rdv)

        def close():
            closed.append(True)
            if gloo.close is not None:
                gloo.close()

        # the ring's store and prefix come along: the runtime may put shared memory in front
        return dataclasses.replace(gloo, backend=_Counting(gloo.backend), close=close)

    register_backend("counting", factory)
    hvd.init()
    try:
        layers, layer = [], engine().backend  # outermost first
        while layer is not None:
            layers.append(type(layer).__name__)
            layer = getattr(layer, "inner", None)
        counting = engine().backend.inner
        total = hvd.allreduce(torch.tensor([hvd.rank() + 1.0]), op=hvd.Sum).item()
        plane = data_plane()
        facts = {
            "name": backend_name(),
            "sum": total,
            "calls": counting.calls,
            "layers": layers,
            "mode": plane["mode"],
            "shm_ops": plane["ops"]["shm"],
        }
    finally:
        hvd.shutdown()
    facts["closed"] = closed
    return facts


def test_init_picks_the_backend_ring_backend_names_with_shared_memory_in_front_of_it():
    """A backend registered from outside gets what the built-in ones get: on one host the
    shared-memory plane sits in front of it (it was once wired inside Gloo's connect only),
    and what the plane does not carry goes through it."""
    facts = run_workers(_counting_worker, np=2, env={"RING_BACKEND": "counting"})
    for f in facts:
        assert f["name"] == "counting" and f["sum"] == 3.0
        assert f["layers"][:2] == ["ShmBackend", "_Counting"], f["layers"]
        assert f["mode"] == "flat" and f["shm_ops"] >= 1
        # the plane's start-up vote and rank 0's offer went through the registered backend
        assert f["calls"][:2] == ["allreduce", "broadcast_object"]
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
