"""Pure unit tests: which interface the Gloo data plane binds to, and host-major ranks."""

from __future__ import annotations

import logging
import os
import socket

import pytest

from ringcore import topology_from_hosts
from ringcore.rendezvous import iface as _iface
from ringcore.rendezvous.topology import host_major_order

IFACES = {"lo": "127.0.0.1", "eth0": "198.18.0.11", "docker0": "172.17.0.1"}


def test_the_interface_on_the_route_to_the_store_is_chosen():
    choice = _iface.choose_interface({}, "198.18.0.11", IFACES)
    assert choice.name == "eth0"
    assert "198.18.0.11" in choice.reason


def test_a_loopback_store_chooses_lo():
    assert _iface.choose_interface({}, "127.0.0.1", IFACES).name == "lo"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"RING_IFACE": "eth1", "GLOO_SOCKET_IFNAME": "eth2"}, "eth1"),
        ({"HOROVOD_GLOO_IFACE": "eth1", "GLOO_SOCKET_IFNAME": "eth2"}, "eth1"),
        ({"GLOO_SOCKET_IFNAME": "eth2", "NCCL_SOCKET_IFNAME": "eth3"}, "eth2"),
        ({"NCCL_SOCKET_IFNAME": "eth3"}, "eth3"),
        ({"NCCL_SOCKET_IFNAME": "^docker"}, "eth0"),  # NCCL's exclusion form: not a name
    ],
)
def test_overrides_win_in_order(env, expected):
    assert _iface.choose_interface(env, "198.18.0.11", IFACES).name == expected


def test_no_route_or_unknown_address_leaves_gloo_alone():
    assert _iface.choose_interface({}, None, IFACES).name is None
    unknown = _iface.choose_interface({}, "10.1.2.3", IFACES)
    assert unknown.name is None
    assert "10.1.2.3" in unknown.reason


def test_this_machine_maps_loopback_to_lo():
    assert _iface.interface_addresses().get("lo") == "127.0.0.1"
    assert _iface.route_address("127.0.0.1", 1) == "127.0.0.1"


def test_apply_sets_gloo_and_nccl_and_restore_undoes_it(monkeypatch, caplog):
    for var in ("RING_IFACE", "HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        assert _iface.apply("127.0.0.1", 1234).name == "lo"
    assert os.environ["GLOO_SOCKET_IFNAME"] == os.environ["NCCL_SOCKET_IFNAME"] == "lo"
    assert "data-plane interface lo" in caplog.text
    _iface.restore()
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    assert "NCCL_SOCKET_IFNAME" not in os.environ


def test_apply_keeps_what_the_user_set(monkeypatch):
    monkeypatch.delenv("RING_IFACE", raising=False)
    monkeypatch.delenv("HOROVOD_GLOO_IFACE", raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth9")
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "eth8")
    assert _iface.apply("127.0.0.1", 1234).name == "eth9"
    assert (os.environ["GLOO_SOCKET_IFNAME"], os.environ["NCCL_SOCKET_IFNAME"]) == ("eth9", "eth8")
    _iface.restore()
    assert os.environ["GLOO_SOCKET_IFNAME"] == "eth9"


def test_host_major_order_makes_ranks_of_a_host_consecutive():
    slots = ["b", "a", "b", "a", "c", "c"]
    order = host_major_order(slots)
    assert order == [0, 2, 1, 3, 4, 5]
    assert [slots[s] for s in order] == ["b", "b", "a", "a", "c", "c"]


def test_host_major_ranks_give_horovods_cross_rank_for_interleaved_hosts():
    slots = ["h1", "h2", "h1", "h2", "h1", "h2"]  # as a barrier stage may place its tasks
    hosts = [slots[s] for s in host_major_order(slots)]
    topos = [topology_from_hosts(hosts, r) for r in range(len(hosts))]
    for t in topos:
        assert t.local_size == 3
        assert t.cross_rank == t.rank // t.local_size
        assert t.local_rank == t.rank % t.local_size
        assert t.cross_size == 2


def test_a_store_name_resolving_to_loopback_here_does_not_put_a_multi_host_ring_on_lo():
    ifaces = {**IFACES, "veth12ab": "10.9.9.9"}
    choice = _iface.choose_interface({}, "127.0.1.1", ifaces, multi_host=True)
    assert choice.name == "eth0"
    assert "spans hosts" in choice.reason
    assert _iface.choose_interface({}, "127.0.1.1", ifaces, multi_host=False).name is None
    only_virtual = {"lo": "127.0.0.1", "docker0": "172.17.0.1"}
    assert _iface.choose_interface({}, "127.0.0.1", only_virtual, multi_host=True).name is None


def test_outward_address_follows_ring_iface_and_is_always_an_address_of_this_host(monkeypatch):
    for var in ("RING_IFACE", "HOROVOD_GLOO_IFACE", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        monkeypatch.delenv(var, raising=False)
    addresses = _iface.interface_addresses()
    monkeypatch.setenv("RING_IFACE", "lo")
    assert _iface.outward_address() == addresses["lo"]
    monkeypatch.delenv("RING_IFACE")
    resolved = socket.gethostbyname(socket.gethostname())
    assert _iface.outward_address() in {*addresses.values(), resolved}
