"""Which network interface a rank's Gloo data plane binds to.

Gloo, left alone, binds to what the hostname resolves to — on many machines
``127.0.1.1`` or ``127.0.0.1`` — and peers on other hosts then fail in
``connectFullMesh``. ringcore instead picks the interface whose address is on the route
to the rendezvous store: the store is the one address every rank has already reached.

Overrides, first set wins: ``RING_IFACE`` (or Horovod's ``HOROVOD_GLOO_IFACE``), then
``GLOO_SOCKET_IFNAME``, then ``NCCL_SOCKET_IFNAME`` (a plain name list, not NCCL's
``^``/``=`` forms). :func:`choose_interface` is the pure decision; :func:`apply` reads
the machine and sets ``GLOO_SOCKET_IFNAME`` (and ``NCCL_SOCKET_IFNAME`` when unset).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import _config as cfg
from .._errors import RendezvousError

__all__ = [
    "NICS_ENV_VARS",
    "IfaceChoice",
    "apply",
    "choose_interface",
    "interface_addresses",
    "is_loopback",
    "nic_names",
    "nics_env",
    "route_address",
]

log = logging.getLogger("ringtrain.ringcore")

_SIOCGIFADDR = 0x8915  # linux/sockios.h


def is_loopback(addr: str) -> bool:
    """True for an address (or name) of this host's loopback: 127.x, localhost, ::1."""
    return addr.startswith("127.") or addr in ("localhost", "::1")


#: The variables a launcher's ``nics=`` sets for its workers: ours and those Gloo and NCCL read.
NICS_ENV_VARS = (cfg.IFACE_ENV_VAR, "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def nic_names(nics: Any, where: str = "nics", hosts: str = "") -> tuple[str, ...]:
    """A launcher's ``nics`` (a str, a set or a list of interface names) as a tuple: a set
    sorted (the same on every run), a list kept in order, duplicates dropped. ``where``
    names the argument in errors; ``hosts`` says whose interfaces to list."""
    if isinstance(nics, str):
        names: list[Any] = [n.strip() for n in nics.split(",")]
    elif isinstance(nics, (set, frozenset)):
        names = sorted(nics, key=str)
    elif isinstance(nics, (list, tuple)):
        names = list(nics)
    else:
        raise TypeError(
            f"{where} takes interface names (a set or list of str, e.g. {{'eth0'}}), "
            f"got {type(nics).__name__}"
        )
    bad = [n for n in names if not isinstance(n, str) or not n or any(c in n for c in ", \t")]
    if bad or not names:
        raise ValueError(
            f"{where}={nics!r}: each interface is a non-empty name such as 'eth0' (no commas or "
            f"spaces){'; got ' + repr(bad[0]) if bad else '; got none'}. List the interfaces"
            f"{hosts} with `ip -br link`."
        )
    return tuple(dict.fromkeys(names))


def nics_env(nics: tuple[str, ...] | None) -> dict[str, str]:
    """The workers' environment for ``nics``: every variable of :data:`NICS_ENV_VARS`."""
    return dict.fromkeys(NICS_ENV_VARS, ",".join(nics)) if nics else {}


@dataclass(frozen=True)
class IfaceChoice:
    name: str | None  # None: leave Gloo to its own default
    reason: str


# Interfaces that are never the way to another host (containers' bridges, tunnels' ends).
_VIRTUAL = ("lo", "docker", "br-", "veth", "virbr", "cni", "flannel", "cali", "tun", "tap")


def choose_interface(
    env: Mapping[str, str],
    route_addr: str | None,
    interfaces: Mapping[str, str],
    multi_host: bool = False,
) -> IfaceChoice:
    """The interface(s) for Gloo, from the environment, the local address on the route
    to the store (``route_addr``) and the IPv4 address of every interface.

    ``multi_host``: the job's ranks span hosts. A loopback route then means the store's
    name resolves to loopback here only (rank 0's own hostname in ``/etc/hosts`` as
    127.0.1.1, say): the first interface that is not loopback or virtual is taken."""
    for var in (cfg.IFACE_ENV_VAR, cfg.HOROVOD_GLOO_IFACE_ENV_VAR, "GLOO_SOCKET_IFNAME"):
        if env.get(var):
            return IfaceChoice(env[var], f"{var} is set")
    nccl = env.get("NCCL_SOCKET_IFNAME", "")
    if nccl and not nccl.startswith(("^", "=")):
        return IfaceChoice(nccl, "NCCL_SOCKET_IFNAME is set")
    if route_addr is None:
        return IfaceChoice(None, "no route to the store was found")
    if multi_host and route_addr.startswith("127."):
        outward = sorted(n for n in interfaces if not n.startswith(_VIRTUAL))
        if not outward:
            return IfaceChoice(None, "the store is on loopback here but the job spans hosts")
        return IfaceChoice(
            outward[0],
            f"the store resolves to {route_addr} here but the job spans hosts: "
            f"{outward[0]} ({interfaces[outward[0]]}) is the first interface that is not "
            "loopback",
        )
    names = sorted(name for name, addr in interfaces.items() if addr == route_addr)
    if not names:
        return IfaceChoice(None, f"no interface has the address {route_addr} on the route")
    return IfaceChoice(names[0], f"{names[0]} has {route_addr}, the route to the store")


def route_address(addr: str, port: int) -> str | None:
    """The local IPv4 address the kernel would use to reach ``addr`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((addr, port or 1))
            return str(sock.getsockname()[0])
    except OSError as exc:
        log.debug("no IPv4 route to %s:%s: %s", addr, port, exc)
        return None


def interface_addresses() -> dict[str, str]:
    """Every interface's IPv4 address (interfaces without one are left out)."""
    found: dict[str, str] = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, request)
            except OSError:
                continue
            found[name] = socket.inet_ntoa(reply[20:24])
    return found


def outward_address() -> str:
    """This host's IPv4 address for peers on other hosts when no store address tells the
    route (``mpirun`` across hosts): the interface ``RING_IFACE`` (or Gloo's / NCCL's
    variable) names, else the one holding the hostname's address, else — the hostname
    resolving to loopback, as on many clusters — the first interface that is neither
    loopback nor virtual."""
    interfaces = interface_addresses()
    try:
        resolved = socket.gethostbyname(socket.gethostname())
    except OSError:
        resolved = "127.0.0.1"
    choice = choose_interface(os.environ, resolved, interfaces, multi_host=True)
    name = (choice.name or "").split(",")[0]
    if name in interfaces:
        log.info("coordinator address %s on %s (%s)", interfaces[name], name, choice.reason)
        return interfaces[name]
    if not resolved.startswith("127."):
        return resolved
    raise RendezvousError(
        f"ringcore found no address of this host that other hosts can reach (the hostname "
        f"resolves to {resolved}; {choice.reason}); set {cfg.IFACE_ENV_VAR} to the interface "
        f"that reaches them, or {cfg.HOSTNAME_ENV_VAR} to this host's address"
    )


_set_by_us: dict[str, str] = {}


def apply(store_addr: str, store_port: int, multi_host: bool = False) -> IfaceChoice:
    """Choose the data-plane interface and set it for Gloo (and NCCL) in ``os.environ``."""
    env = {k: v for k, v in os.environ.items() if _set_by_us.get(k) != v}
    route = route_address(store_addr, store_port)
    choice = choose_interface(env, route, interface_addresses(), multi_host)
    if choice.name is None:
        log.warning(
            "ringcore could not choose a data-plane interface (%s); Gloo binds to what "
            "the hostname resolves to. Set %s to the interface that reaches the other hosts.",
            choice.reason,
            cfg.IFACE_ENV_VAR,
        )
        return choice
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        if var not in env or (var == "GLOO_SOCKET_IFNAME" and env[var] != choice.name):
            if var in env:
                log.warning("%s=%s is overridden by %s", var, env[var], choice.reason)
            os.environ[var] = choice.name
            _set_by_us[var] = choice.name
    log.info("data-plane interface %s (%s)", choice.name, choice.reason)
    return choice


def restore() -> None:
    """Undo what :func:`apply` set, so that the next ``init()`` decides afresh."""
    for var, value in list(_set_by_us.items()):
        if os.environ.get(var) == value:
            del os.environ[var]
        del _set_by_us[var]
