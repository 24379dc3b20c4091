"""Hosts made of Linux network namespaces on one bridge, for multi-host tests.

Each host is a namespace with ``lo`` up and an ``eth0`` (one end of a veth pair whose
other end is on the bridge) holding an address in 198.18.0.0/15 (RFC 2544's benchmark
range: never routed anywhere). Commands run on a host through :meth:`Host.wrap`:
``ip netns exec`` plus ``unshare --uts`` so that the host has a hostname of its own,
which ``/etc/netns/<ns>/hosts`` resolves to 127.0.0.1 there (and to the host's address
on the other hosts) — the loopback-resolving hostname that real clusters often have and
that Gloo, left alone, would advertise.

Names carry an id (the creating pid by default) so that parallel runs and leftovers do
not collide; :meth:`Cluster.down` removes everything :meth:`Cluster.up` made, and is
safe to call after a partial ``up``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

NETNS_DIR = "/etc/netns"


def unavailable() -> str | None:
    """Why netns hosts cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network-namespace hosts need root"
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            return f"network-namespace hosts need the {tool!r} command"
    probe = f"rtprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"'ip netns add' fails here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")
    return done


def _free_subnet(preferred: int) -> int:
    """A third octet ``n`` such that no route of this machine is in 198.18.n.0/24."""
    routes = _ip("-4", "route", "show", "table", "all").stdout
    for k in range(254):
        n = (preferred + k) % 254 + 1
        if f"198.18.{n}." not in routes:
            return n
    raise RuntimeError("every 198.18.n.0/24 subnet is in use on this machine")


@dataclass(frozen=True)
class Host:
    ns: str  # the namespace's name
    addr: str  # eth0's address on the bridge
    hostname: str  # resolves to 127.0.0.1 inside the namespace

    def wrap(self, cmd: list[str]) -> list[str]:
        """``cmd`` run on this host (its network namespace, its own hostname)."""
        return [
            "ip", "netns", "exec", self.ns,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', self.hostname, *cmd,
        ]  # fmt: skip


@dataclass
class Cluster:
    """``n`` hosts on one bridge; the bridge (the root namespace) has ``.1``."""

    n: int = 2
    tag: str = field(default_factory=lambda: str(os.getpid() % 100000))
    subnet: int | None = None  # the third octet; None: a free one
    hosts: list[Host] = field(default_factory=list)
    bridge_addr: str = ""

    @property
    def bridge(self) -> str:
        return f"rtb{self.tag}"

    def up(self) -> Cluster:
        try:
            self._up()
        except BaseException:
            self.down()
            raise
        return self

    def _up(self) -> None:
        octet = self.subnet if self.subnet is not None else _free_subnet(int(self.tag) % 254)
        self.bridge_addr = f"198.18.{octet}.1"
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("addr", "add", f"{self.bridge_addr}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        names = [
            Host(f"rt{self.tag}h{i}", f"198.18.{octet}.{11 + i}", f"rthost{self.tag}-{i}")
            for i in range(self.n)
        ]
        for i, host in enumerate(names):
            self.hosts.append(host)
            # Its own name on loopback, the other hosts' names on their addresses (DNS).
            peers = "".join(f"{h.addr} {h.hostname}\n" for h in names if h is not host)
            os.makedirs(os.path.join(NETNS_DIR, host.ns), exist_ok=True)
            with open(os.path.join(NETNS_DIR, host.ns, "hosts"), "w") as f:
                f.write(f"127.0.0.1 localhost {host.hostname}\n{peers}")
            _ip("netns", "add", host.ns)
            veth, peer = f"rt{self.tag}v{i}", f"rt{self.tag}p{i}"
            _ip("link", "add", veth, "type", "veth", "peer", "name", peer)
            _ip("link", "set", peer, "netns", host.ns)
            _ip("link", "set", veth, "master", self.bridge)
            _ip("link", "set", veth, "up")
            _ip("-n", host.ns, "link", "set", peer, "name", "eth0")
            _ip("-n", host.ns, "addr", "add", f"{host.addr}/24", "dev", "eth0")
            _ip("-n", host.ns, "link", "set", "eth0", "up")
            _ip("-n", host.ns, "link", "set", "lo", "up")

    def down(self) -> None:
        """Remove the namespaces (their veth ends go with them), veths and the bridge."""
        for i in range(self.n):
            ns = f"rt{self.tag}h{i}"
            _ip("netns", "delete", ns, check=False)
            _ip("link", "delete", f"rt{self.tag}v{i}", check=False)
            shutil.rmtree(os.path.join(NETNS_DIR, ns), ignore_errors=True)
        _ip("link", "delete", self.bridge, check=False)
        self.hosts = []
        with contextlib.suppress(OSError):
            os.rmdir(NETNS_DIR)  # only when empty: other namespaces' files stay


def kill_tree(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End ``proc`` (started with ``start_new_session=True``), every process below it
    (found through /proc, by parent pid) and its process group — by pid, nothing else."""
    tree = [proc.pid, *_descendants(proc.pid)]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in tree:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
        if not any(alive(pid) for pid in tree[1:]) and proc.poll() is not None:
            return


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def python_stacks(root: int, title_prefix: bytes = b"") -> str:
    """The Python stacks of every process below ``root`` whose command line starts with
    ``title_prefix`` (e.g. ``b"ray::RingWorker"``), as ``py-spy dump`` prints them: what
    a hung test reports. Empty when py-spy (the dev extra) is not installed."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.path.exists(spy):
        return ""
    out = []
    for pid in _descendants(root):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if not f.read().startswith(title_prefix):
                    continue
        except OSError:
            continue
        try:
            dump = subprocess.run(
                [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=30
            )
            out.append(f"--- stacks of pid {pid}\n{dump.stdout}{dump.stderr}")
        except subprocess.TimeoutExpired:
            out.append(f"--- stacks of pid {pid}: py-spy did not answer in 30 s")
    return "\n".join(out)
