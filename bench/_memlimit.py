"""A memory limit per worker process for bench/sharded.py: a cgroup of its own when the
kernel offers one, else ``RLIMIT_AS``.

The driver calls :func:`probe` (which way this machine allows, and why) and
:func:`make_parent` (a folder ``ringbench-<pid>`` under this process's own memory cgroup,
so whatever limits that cgroup has still hold over it); each worker calls :func:`join`
as its first statement, before importing torch, which makes a child ``w<pid>`` with the
limit and moves the worker into it; after the run the driver calls :func:`collect`,
which reads every child's counters (limit, peak, how often the limit was hit, OOM kills)
and removes the folders. Standard library only: a worker imports it before torch.

- ``cgroup2``: ``memory.max`` (``memory.swap.max`` 0) on the cgroup2 mount whose
  ``cgroup.controllers`` holds ``memory``;
- ``cgroup1``: ``memory.limit_in_bytes`` on the v1 ``memory`` hierarchy (hybrid hosts,
  whose cgroup2 mount lacks the memory controller);
- ``rlimit_as``: ``setrlimit(RLIMIT_AS)``, address space rather than memory in use, when
  no writable memory cgroup exists.
"""

from __future__ import annotations

import os
import pathlib
import resource

MODES = ("cgroup2", "cgroup1", "rlimit_as")


def _mounts() -> list[tuple[pathlib.Path, str, str]]:
    out = []
    for line in pathlib.Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] in ("cgroup", "cgroup2"):
            out.append((pathlib.Path(fields[1]), fields[2], fields[3]))
    return out


def _own(version: str) -> str:
    """This process's cgroup path in the v2 hierarchy (``"2"``) or v1's memory one."""
    for line in pathlib.Path("/proc/self/cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if (version == "2" and hid == "0") or (
            version == "1" and "memory" in controllers.split(",")
        ):
            return path.lstrip("/")
    return ""


def probe() -> tuple[str, pathlib.Path | None, str]:
    """(mode, the folder the driver's cgroup lives in or None, why this mode)."""
    why = []
    for mount, kind, _ in _mounts():
        if kind == "cgroup2":
            controllers = (mount / "cgroup.controllers").read_text().split()
            if "memory" in controllers and os.access(mount, os.W_OK):
                return "cgroup2", mount, f"cgroup2 at {mount} has the memory controller"
            why.append(f"cgroup2 at {mount} has controllers {controllers or 'none'}, not memory")
    for mount, kind, options in _mounts():
        if kind == "cgroup" and "memory" in options.split(","):
            own = mount / _own("1")
            if own.is_dir() and os.access(own, os.W_OK):
                return "cgroup1", own, "; ".join([*why, f"cgroup v1 memory at {own} is writable"])
            why.append(f"cgroup v1 memory at {own} is not writable")
    return "rlimit_as", None, "; ".join([*why, "no writable memory cgroup: RLIMIT_AS"])


def make_parent(mode: str, where: pathlib.Path | None) -> pathlib.Path | None:
    """The folder the workers' cgroups go in (None under ``rlimit_as``)."""
    if mode == "rlimit_as" or where is None:
        return None
    parent = where / f"ringbench-{os.getpid()}"
    parent.mkdir()
    if mode == "cgroup2":  # the root may hold processes; a child with children may not
        for folder in (where, parent):
            (folder / "cgroup.subtree_control").write_text("+memory")
    return parent


def join(mode: str, parent: str, limit: int) -> None:
    """This process (and what it starts) held to ``limit`` bytes from now on."""
    if mode == "rlimit_as":
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
        return
    own = pathlib.Path(parent) / f"w{os.getpid()}"
    own.mkdir()
    if mode == "cgroup2":
        (own / "memory.max").write_text(str(limit))
        (own / "memory.swap.max").write_text("0")
    else:
        (own / "memory.limit_in_bytes").write_text(str(limit))
    (own / "cgroup.procs").write_text(str(os.getpid()))


def _read(path: pathlib.Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _stats(mode: str, child: pathlib.Path) -> dict[str, int | None]:
    def number(name: str) -> int | None:
        text = _read(child / name).strip()
        return int(text) if text.isdigit() else None

    def field(name: str, key: str) -> int | None:
        for line in _read(child / name).splitlines():
            k, _, v = line.partition(" ")
            if k == key and v.strip().isdigit():
                return int(v)
        return None

    if mode == "cgroup2":
        return {
            "limit": number("memory.max"),
            "peak": number("memory.peak"),
            "limit_hit": field("memory.events", "max"),
            "oom_kill": field("memory.events", "oom_kill"),
        }
    return {
        "limit": number("memory.limit_in_bytes"),
        "peak": number("memory.max_usage_in_bytes"),
        "limit_hit": number("memory.failcnt"),
        "oom_kill": field("memory.oom_control", "oom_kill"),
    }


def collect(mode: str, parent: pathlib.Path | None) -> list[dict[str, int | None]]:
    """Every worker cgroup's counters; removes them and ``parent`` (the workers are gone)."""
    if parent is None:
        return []
    found = []
    for child in sorted(parent.glob("w*")):
        found.append({"pid": int(child.name[1:]), **_stats(mode, child)})
        child.rmdir()
    parent.rmdir()
    return found
