"""Other hosts: which hosts are this one, the address they reach ringrun on, and ssh.

A rank on another host runs through ``ssh -o BatchMode=yes [-p PORT] [-i KEY] host 'cd
CWD && exec PYTHON -m ringrun._remote'`` (passwordless ssh, and the same paths on every
host: this interpreter, the working directory; as horovodrun assumes); its command and
environment travel on ssh's standard input (:mod:`ringrun._remote`). ``RINGRUN_SSH``
names another program to run in ssh's place, with the same arguments (a test enters a
network-namespace host with it; a site may wrap ssh).
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys

from ringcore import RingError
from ringcore.launch import interface_addresses
from ringcore.launch import route_address as _route

from ._args import UsageError

__all__ = [
    "SSH_ENV_VAR",
    "interface_address",
    "is_local",
    "remote_free_port",
    "route_address",
    "ssh_command",
]

#: a program to run in ssh's place (same arguments)
SSH_ENV_VAR = "RINGRUN_SSH"


def is_local(host: str) -> bool:
    """True when ``host`` is this machine: loopback, or an address a socket here can bind."""
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        addr = socket.gethostbyname(host)
    except OSError:
        return False  # ssh will say what is wrong with the name
    if addr.startswith("127."):
        return True
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.bind((addr, 0))
            return True
        except OSError:
            return False


def route_address(host: str) -> str:
    """This machine's IPv4 address on the route to ``host`` (no packet is sent)."""
    try:
        addr = _route(socket.gethostbyname(host), 9)
        problem = "no route"
    except OSError as exc:
        addr, problem = None, f"its name does not resolve: {exc}"
    if addr is None:
        raise UsageError(
            f"ringrun runs a worker on {host!r}, but this host has {problem}; check the "
            "name, or pass --network-interface with the interface that reaches the other hosts"
        )
    return addr


def interface_address(name: str) -> str | None:
    """The IPv4 address of this machine's interface ``name`` (None: it has none here)."""
    return interface_addresses().get(name)


def ssh_command(host: str, port: int | None, identity: str | None, remote: list[str]) -> list[str]:
    """The argv that runs ``remote`` (argv on ``host``) in this working directory there."""
    program = os.environ.get(SSH_ENV_VAR) or "ssh"
    argv = [program, "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=accept-new"]
    if port is not None:
        argv += ["-p", str(port)]
    if identity:
        argv += ["-i", identity]
    pythonpath = os.environ.get("PYTHONPATH")
    env = f"env PYTHONPATH={shlex.quote(pythonpath)} " if pythonpath else ""
    line = f"cd {shlex.quote(os.getcwd())} && exec {env}{shlex.join(remote)}"
    return [*argv, host, line]


def remote_free_port(host: str, port: int | None, identity: str | None, timeout_s: float) -> int:
    """A TCP port free on ``host`` now (asked over ssh): rank 0's ``MASTER_PORT``."""
    argv = ssh_command(
        host, port, identity, [sys.executable, "-m", "ringrun._remote", "--free-port"]
    )
    try:
        done = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout_s
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RingError(f"could not reach {host!r} with {argv[0]!r}: {exc}") from None
    out = done.stdout.strip().splitlines()
    if done.returncode != 0 or not out or not out[-1].isdigit():
        raise RingError(
            f"could not start a process on {host!r} through {argv[0]} (exit {done.returncode}): "
            f"{done.stderr.strip()[-500:]}. ringrun needs passwordless ssh to every host "
            f"(ssh {host} true must work) and this Python ({sys.executable}) and working "
            "directory at the same paths there"
        )
    return int(out[-1])
