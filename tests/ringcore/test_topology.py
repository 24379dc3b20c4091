"""Pure unit tests: topology, rendezvous environment, reduce ops, errors."""

from __future__ import annotations

import pickle

import pytest

import ringcore
from ringcore import RendezvousError, Topology, WorkerError, topology_from_hosts
from ringcore._ops import ReduceOp, resolve_op
from ringcore.rendezvous.environment import read_environment


def test_topology_from_hosts_gives_local_ranks_in_rank_order_per_host():
    hosts = ["a", "b", "a", "b", "a"]
    topos = [topology_from_hosts(hosts, r) for r in range(5)]
    assert [t.local_rank for t in topos] == [0, 0, 1, 1, 2]
    assert [t.local_size for t in topos] == [3, 2, 3, 2, 3]
    # cross rank: index of the host among hosts that have this local rank
    assert [t.cross_rank for t in topos] == [0, 1, 0, 1, 0]
    assert [t.cross_size for t in topos] == [2, 2, 2, 2, 1]
    assert not topos[0].is_homogeneous


def test_topology_from_hosts_single_host_is_homogeneous():
    t = topology_from_hosts(["h"] * 4, 3)
    assert (t.rank, t.size, t.local_rank, t.local_size, t.cross_rank, t.cross_size) == (
        3,
        4,
        3,
        4,
        0,
        1,
    )
    assert t.is_homogeneous


def test_topology_from_hosts_rejects_rank_outside_hosts():
    with pytest.raises(ValueError, match="rank 2 is outside the 2 hosts"):
        topology_from_hosts(["a", "b"], 2)
    with pytest.raises(ValueError, match="hosts is empty"):
        topology_from_hosts([], 0)


def test_topology_validates_on_construction():
    with pytest.raises(ValueError, match="rank must be in"):
        Topology(rank=2, size=2, local_rank=0, local_size=1, cross_rank=0, cross_size=1)


def _clear(monkeypatch):
    for name in (
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
        "GROUP_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_USE_AGENT_STORE",
    ):
        monkeypatch.delenv(name, raising=False)
    for prefix in ("RING_", "HOROVOD_"):
        for suffix in (
            "RANK",
            "SIZE",
            "LOCAL_RANK",
            "LOCAL_SIZE",
            "CROSS_RANK",
            "CROSS_SIZE",
            "STORE_ADDR",
            "STORE_PORT",
            "STORE_EXTERNAL",
        ):
            monkeypatch.delenv(prefix + suffix, raising=False)


def test_environment_of_our_runners_is_read(monkeypatch):
    _clear(monkeypatch)
    env = ringcore.worker_env(topology_from_hosts(["x", "y", "x"], 2), "10.0.0.9", 4242)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rdv = read_environment()
    assert rdv.topology == Topology(2, 3, 1, 2, 0, 1)
    assert (rdv.store_addr, rdv.store_port, rdv.is_store_host) == ("10.0.0.9", 4242, False)


def test_horovod_spelling_of_the_variables_is_accepted(monkeypatch):
    _clear(monkeypatch)
    for k, v in {
        "HOROVOD_RANK": "0",
        "HOROVOD_SIZE": "2",
        "HOROVOD_LOCAL_RANK": "0",
        "HOROVOD_LOCAL_SIZE": "2",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(k, v)
    rdv = read_environment()
    assert (rdv.topology.rank, rdv.topology.size, rdv.topology.local_size) == (0, 2, 2)
    assert rdv.is_store_host and rdv.store_port == 29500


def test_torchrun_environment_is_read_and_agent_store_respected(monkeypatch):
    _clear(monkeypatch)
    for k, v in {
        "RANK": "0",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "2",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29400",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
    }.items():
        monkeypatch.setenv(k, v)
    rdv = read_environment()
    assert rdv.topology == Topology(0, 4, 0, 2, 0, 2)
    assert rdv.source == "torchrun" and not rdv.is_store_host


def test_no_environment_means_a_single_process(monkeypatch):
    _clear(monkeypatch)
    rdv = read_environment()
    assert rdv.topology.size == 1 and rdv.is_store_host


def test_incomplete_ring_environment_names_the_missing_variables(monkeypatch):
    _clear(monkeypatch)
    monkeypatch.setenv("RING_RANK", "1")
    monkeypatch.setenv("RING_SIZE", "2")
    with pytest.raises(RendezvousError, match="RING_STORE_ADDR/RING_STORE_PORT"):
        read_environment()


def test_topology_queries_before_init_raise_clearly():
    ringcore.shutdown()
    for query in (ringcore.rank, ringcore.size, ringcore.local_rank, ringcore.cross_size):
        with pytest.raises(ringcore.NotInitializedError, match="call init\\(\\) first"):
            query()


def test_single_process_init_works_and_shutdown_then_init_again(monkeypatch):
    _clear(monkeypatch)
    import torch

    import ringcore.torch as hvd

    for _ in range(2):
        hvd.init()
        assert (hvd.rank(), hvd.size(), hvd.local_rank()) == (0, 1, 0)
        assert hvd.allreduce(torch.tensor([3.0])).item() == 3.0
        hvd.shutdown()
        assert not hvd.is_initialized()


def test_resolve_op_follows_horovod_rules():
    assert resolve_op(None, None) is ReduceOp.Average
    assert resolve_op(False, None) is ReduceOp.Sum
    assert resolve_op(None, ringcore.Max) is ReduceOp.Max
    with pytest.raises(ValueError, match="both average"):
        resolve_op(True, ringcore.Sum)
    with pytest.raises(ValueError, match="not a reduce operator"):
        resolve_op(None, 42)


def test_worker_error_survives_pickling_with_its_fields():
    try:
        raise KeyError("missing")
    except KeyError as exc:
        err = WorkerError.from_exception(3, "host-a", exc)
    back = pickle.loads(pickle.dumps(err))
    assert (back.rank, back.host, back.error_type) == (3, "host-a", "KeyError")
    assert "raise KeyError" in back.traceback and "rank 3 on host host-a" in str(back)


def test_horovod_internal_error_is_an_alias():
    assert ringcore.HorovodInternalError is ringcore.RingInternalError
    assert issubclass(ringcore.RingInternalError, ringcore.RingError)


def test_launched_ranks_get_a_bounded_stall_shutdown_unless_the_launcher_says_otherwise(
    monkeypatch,
):
    topo = topology_from_hosts(["x", "x"], 0)
    for name in ("RING_STALL_SHUTDOWN_TIME_SECONDS", "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS"):
        monkeypatch.delenv(name, raising=False)
    assert ringcore.worker_env(topo, "h", 1)["RING_STALL_SHUTDOWN_TIME_SECONDS"] == "600"
    monkeypatch.setenv("HOROVOD_STALL_SHUTDOWN_TIME_SECONDS", "0")  # Horovod's "never"
    assert ringcore.worker_env(topo, "h", 1)["RING_STALL_SHUTDOWN_TIME_SECONDS"] == "0"
