"""ringrun's command line: Horovod's flags, parsed and checked before anything starts.

:func:`parse` turns ``argv`` into one frozen :class:`Options`; every refusal (an unknown
flag, a ``-H`` entry that does not parse, ``-np`` below 1 or above the hosts' slots, two
launch modes at once) is a :class:`UsageError` naming the value and the fix, raised
before a store, a process or a cluster starts.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import sys
from dataclasses import dataclass

from ringcore import RingError
from ringcore.launch import (
    AUTOTUNE_ENV_VAR,
    AUTOTUNE_LOG_ENV_VAR,
    CACHE_CAPACITY_ENV_VAR,
    CYCLE_TIME_ENV_VAR,
    ELASTIC_TIMEOUT_ENV_VAR,
    FUSION_THRESHOLD_ENV_VAR,
    LOG_LEVEL_ENV_VAR,
    START_TIMEOUT_ENV_VAR,
    TIMELINE_ENV_VAR,
    TIMELINE_MARK_CYCLES_ENV_VAR,
    ElasticNames,
    check_elastic_limits,
)

__all__ = ["Options", "UsageError", "host_slots", "parse", "parser", "rank_hosts"]

#: ringrun's names of the elastic limits, for ``check_elastic_limits``' messages
ELASTIC_NAMES = ElasticNames(
    min="--min-np",
    max="--max-np",
    num="-np",
    reset_limit="--reset-limit",
    timeout="--elastic-timeout",
    max_none="unset",
)


class UsageError(RingError, ValueError):
    """ringrun's command line asks for something it cannot run (exit status 2)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise UsageError(
            f"{message}. ringrun's own flags come before the command (ringrun -np 2 python "
            "train.py --lr 0.1); ringrun --help lists them"
        )


@dataclass(frozen=True)
class Options:
    """What one ``ringrun`` call asks for (see :func:`parser` for each flag)."""

    command: tuple[str, ...]
    np: int
    hosts: tuple[tuple[str, int], ...] = ()  # (host, slots), in the order given
    ssh_port: int | None = None
    ssh_identity_file: str | None = None
    mpi: bool = False
    nics: tuple[str, ...] = ()
    start_timeout: float | None = None
    env: tuple[tuple[str, str], ...] = ()  # the RING_* knobs of Horovod's flags
    verbose: bool = False
    spark: bool = False
    master: str | None = None
    ray: bool = False
    address: str | None = None
    # elastic (as horovodrun's): the ring re-forms as hosts and workers come and go
    elastic: bool = False
    min_np: int = 1
    max_np: int | None = None
    discovery: tuple[str, ...] = ()  # the host discovery script's argv
    slots_per_host: int | None = None
    elastic_timeout: float | None = None
    reset_limit: int | None = None


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ringrun",
        description="Run a command on N ranks that form one ringtrain ring (as horovodrun).",
        allow_abbrev=False,
    )
    a = p.add_argument
    a("-np", "--num-proc", dest="np", type=int, help="the number of ranks (required)")
    a("-H", "--hosts", help="host:slots,... (default: every rank on this host)")
    a("-hostfile", "--hostfile", help="a file of 'host slots=N' lines (instead of -H)")
    a("-p", "--ssh-port", type=int, help="the port ssh connects to on the other hosts")
    a("-i", "--ssh-identity-file", help="the key ssh uses for the other hosts")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--gloo", action="store_true", help="ringrun starts the ranks (default)")
    mode.add_argument("--mpi", action="store_true", help="start the ranks with mpirun")
    a("--network-interface", "--network-interfaces", dest="nics", help="NIC[,NIC...]")
    a("--start-timeout", type=float, help="seconds the ranks wait for each other")
    a("--timeline-filename", help="write the op timeline here (RING_TIMELINE)")
    a("--timeline-mark-cycles", action="store_true", help="mark engine cycles in the timeline")
    a("--fusion-threshold-mb", type=float, help="tensor fusion buffer, MiB")
    a("--cycle-time-ms", type=float, help="engine cycle time, ms")
    a("--cache-capacity", type=int, help="response cache entries")
    a("--autotune", action="store_true", help="tune fusion and cycle time while training")
    a("--autotune-log-file", help="where autotune logs what it tried")
    a("--log-level", choices=["TRACE", "DEBUG", "INFO", "WARNING", "ERROR", "FATAL"])
    a("-v", "--verbose", action="store_true", help="say what ringrun starts where (stderr)")
    e = p.add_argument_group("elastic (as horovodrun's)").add_argument
    e("--min-np", "--min-num-proc", dest="min_np", type=int, help="fewest workers (default -np)")
    e("--max-np", "--max-num-proc", dest="max_np", type=int, help="most workers (default: slots)")
    e("--host-discovery-script", help="prints the hosts now, one host:slots a line")
    e("--slots-per-host", "--slots", dest="slots", type=int, help="slots of a bare host line")
    e("--elastic-timeout", type=float, help="seconds below --min-np before failing (600)")
    e("--reset-limit", type=int, help="the most times the ring may re-form")
    a("--spark", action="store_true", help="run the ranks as one Spark barrier stage")
    a("--master", help="with --spark: local[N], spark://..., sc://... (Spark Connect)")
    a("--ray", action="store_true", help="run the ranks as Ray actors")
    a("--address", help="with --ray: the cluster's address (auto: the running one)")
    a("command", nargs=argparse.REMAINDER, help="the command every rank runs")
    return p


_ENTRY = re.compile(r"^([^\s:,=]+)(?::(.*))?$")


def _slots(raw: str, entry: str, where: str) -> int:
    try:
        slots = int(raw)
    except ValueError:
        slots = 0
    if slots < 1:
        raise UsageError(
            f"{where}: {entry!r} gives {raw!r} slots; slots are a whole number >= 1 "
            "(host:slots, e.g. node1:4)"
        )
    return slots


def host_slots(spec: str, where: str = "-H") -> list[tuple[str, int]]:
    """``"a:4,b:4"`` -> ``[("a", 4), ("b", 4)]`` (a host without ``:N`` has 1 slot)."""
    out: list[tuple[str, int]] = []
    for entry in spec.split(","):
        m = _ENTRY.match(entry.strip())
        if m is None:
            raise UsageError(
                f"{where}: {entry!r} is not host or host:slots; write e.g. "
                "-H node1:4,node2:4 (no spaces, one entry per host)"
            )
        out.append((m.group(1), 1 if m.group(2) is None else _slots(m.group(2), entry, where)))
    return _no_repeats(out, where)


def _hostfile(path: str) -> list[tuple[str, int]]:
    if not os.path.isfile(path):
        raise UsageError(f"--hostfile {path!r} does not exist; pass a file of 'host slots=N' lines")
    out: list[tuple[str, int]] = []
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            line = raw.split("#", 1)[0].strip()
            if not line:
                continue
            m = re.fullmatch(r"(\S+)(?:\s+slots\s*=\s*(\S+))?", line)
            where = f"--hostfile {path} line {n}"
            if m is None:
                raise UsageError(f"{where}: {line!r} is not 'host' or 'host slots=N'")
            if m.group(2) is not None:
                out.append((m.group(1), _slots(m.group(2), line, where)))
            else:
                out += host_slots(m.group(1), where)
    if not out:
        raise UsageError(f"--hostfile {path!r} names no host; write one 'host slots=N' a line")
    return _no_repeats(out, f"--hostfile {path}")


def _no_repeats(hosts: list[tuple[str, int]], where: str) -> list[tuple[str, int]]:
    seen = [h for h, _ in hosts]
    for h in seen:
        if seen.count(h) > 1:
            raise UsageError(f"{where}: the host {h!r} is listed twice; give it once, host:slots")
    return hosts


def rank_hosts(hosts: tuple[tuple[str, int], ...], np: int) -> list[str]:
    """The host of every rank: the slots filled host by host, in the order given."""
    slots = [h for h, n in hosts for _ in range(n)]
    return slots[:np]


def _is_elastic(ns: argparse.Namespace) -> bool:
    return ns.min_np is not None or ns.max_np is not None or bool(ns.host_discovery_script)


def _check_modes(ns: argparse.Namespace) -> None:
    if ns.spark and ns.ray:
        raise UsageError("--spark and --ray both given; pick the one cluster to run on")
    if ns.master and not ns.spark:
        raise UsageError(f"--master {ns.master!r} is a Spark master; add --spark, or drop it")
    if ns.address and not ns.ray:
        raise UsageError(f"--address {ns.address!r} is a Ray address; add --ray, or drop it")
    engine = "--spark" if ns.spark else "--ray" if ns.ray else None
    if engine and (ns.hosts or ns.hostfile):
        raise UsageError(
            f"{engine} with -H/--hostfile: the cluster places the ranks; drop -H/--hostfile"
        )
    if engine and ns.mpi:
        raise UsageError(f"{engine} with --mpi: the ranks form a Gloo ring there; drop --mpi")
    if ns.hosts and ns.hostfile:
        raise UsageError("-H and --hostfile both given; pass the hosts one way")


def _knobs(ns: argparse.Namespace) -> list[tuple[str, str]]:
    """The RING_* variable of each Horovod tuning flag given (ringcore/_config.py)."""
    env: list[tuple[str, str]] = []
    if ns.fusion_threshold_mb is not None:
        if ns.fusion_threshold_mb < 0:
            raise UsageError(f"--fusion-threshold-mb {ns.fusion_threshold_mb:g} is negative")
        env.append((FUSION_THRESHOLD_ENV_VAR, str(int(ns.fusion_threshold_mb * 1024 * 1024))))
    if ns.cycle_time_ms is not None:
        if ns.cycle_time_ms <= 0:
            raise UsageError(f"--cycle-time-ms {ns.cycle_time_ms:g}: give milliseconds > 0")
        env.append((CYCLE_TIME_ENV_VAR, f"{ns.cycle_time_ms:g}"))
    if ns.cache_capacity is not None:
        env.append((CACHE_CAPACITY_ENV_VAR, str(ns.cache_capacity)))
    if ns.timeline_filename:
        env.append((TIMELINE_ENV_VAR, os.path.abspath(ns.timeline_filename)))
    if ns.timeline_mark_cycles:
        env.append((TIMELINE_MARK_CYCLES_ENV_VAR, "1"))
    if ns.autotune:
        env.append((AUTOTUNE_ENV_VAR, "1"))
    if ns.autotune_log_file:
        env.append((AUTOTUNE_LOG_ENV_VAR, os.path.abspath(ns.autotune_log_file)))
    if ns.log_level:
        env.append((LOG_LEVEL_ENV_VAR, ns.log_level.lower()))
    if ns.start_timeout is not None:
        if ns.start_timeout <= 0:
            raise UsageError(f"--start-timeout {ns.start_timeout:g}: give seconds > 0")
        env.append((START_TIMEOUT_ENV_VAR, f"{ns.start_timeout:g}"))
    if ns.elastic_timeout is not None and ns.elastic_timeout > 0:
        env.append((ELASTIC_TIMEOUT_ENV_VAR, f"{ns.elastic_timeout:g}"))
    return env


def _discovery_argv(script: str) -> tuple[str, ...]:
    """The discovery script's argv (a path as it is, else split as a shell would), checked."""
    argv = (script,) if os.path.isfile(script) else tuple(shlex.split(script))
    program = argv[0] if argv else ""
    where = f"--host-discovery-script {script!r}"
    if os.sep not in program and not os.path.exists(program):
        found = shutil.which(program) if program else None
        if found is None:
            raise UsageError(
                f"{where}: {program!r} is neither a file nor a program on PATH; give the path of "
                "an executable script that prints the hosts, one host:slots a line"
            )
        return (found, *argv[1:])
    if not os.path.isfile(program):
        raise UsageError(
            f"{where}: {program!r} does not exist; give the path of an executable script "
            "that prints the hosts, one host:slots a line"
        )
    if not os.access(program, os.X_OK):
        raise UsageError(f"{where}: {program!r} is not executable; chmod +x {program}")
    return (os.path.abspath(program), *argv[1:])


def _elastic(ns: argparse.Namespace) -> dict:
    """The elastic fields of :class:`Options` (checked: limits, script, modes)."""
    if not _is_elastic(ns):
        for flag, value in (("--slots-per-host", ns.slots), ("--elastic-timeout",
                            ns.elastic_timeout), ("--reset-limit", ns.reset_limit)):  # fmt: skip
            if value is not None:
                raise UsageError(
                    f"{flag} {value} is for elastic jobs; add --min-np/--max-np or "
                    "--host-discovery-script, or drop it"
                )
        return {}
    for flag, on in (("--spark", ns.spark), ("--ray", ns.ray), ("--mpi", ns.mpi)):
        if on:
            raise UsageError(
                f"{flag} with an elastic job: ringrun runs elastic jobs itself (as horovodrun "
                f"with Gloo); drop {flag}, or drop --min-np/--max-np/--host-discovery-script"
            )
    if ns.host_discovery_script and (ns.hosts or ns.hostfile):
        raise UsageError(
            "--host-discovery-script with -H/--hostfile: the script says the hosts; drop one"
        )
    if ns.slots is not None and not ns.host_discovery_script:
        raise UsageError(f"--slots-per-host {ns.slots} needs --host-discovery-script")
    if ns.slots is not None and ns.slots < 1:
        raise UsageError(f"--slots-per-host {ns.slots}: a host has >= 1 slot")
    min_np = ns.min_np if ns.min_np is not None else ns.np
    try:
        check_elastic_limits(
            min_np, ns.max_np, ns.reset_limit, ns.elastic_timeout, num=ns.np, names=ELASTIC_NAMES
        )
    except ValueError as exc:
        raise UsageError(
            f"{exc}; e.g. ringrun --min-np 2 --max-np 4 --host-discovery-script ./hosts.sh "
            "python train.py"
        ) from None
    discovery = _discovery_argv(ns.host_discovery_script) if ns.host_discovery_script else ()
    return {
        "elastic": True,
        "min_np": min_np,
        "max_np": ns.max_np,
        "discovery": discovery,
        "slots_per_host": ns.slots,
        "elastic_timeout": ns.elastic_timeout,
        "reset_limit": ns.reset_limit,
    }


def parse(argv: list[str]) -> Options:
    """``argv`` (without the program name) as :class:`Options`, or :class:`UsageError`."""
    ns = parser().parse_args(argv)
    if not ns.command:
        raise UsageError("no command to run; e.g. ringrun -np 2 python train.py")
    if ns.np is None and _is_elastic(ns):
        ns.np = ns.min_np  # horovodrun's: the ring starts once --min-np slots are there
    if ns.np is None:
        raise UsageError(
            "-np is missing; say how many ranks to run, e.g. -np 4 (elastic: --min-np 2)"
        )
    _check_modes(ns)
    elastic = _elastic(ns)  # first: -np may be --min-np's, named so in its message
    if ns.np < 1:
        raise UsageError(f"-np {ns.np}: the number of ranks must be >= 1")
    hosts = host_slots(ns.hosts) if ns.hosts else _hostfile(ns.hostfile) if ns.hostfile else []
    total = sum(n for _, n in hosts)
    if hosts and ns.np > total:
        given = ",".join(f"{h}:{n}" for h, n in hosts)
        raise UsageError(
            f"-np {ns.np} but the hosts ({given}) have {total} slots; lower -np to {total} "
            "or give the hosts more slots"
        )
    nics = tuple(n.strip() for n in (ns.nics or "").split(",") if n.strip())
    return Options(
        command=through_guard(tuple(ns.command)),
        np=ns.np,
        hosts=tuple(hosts),
        ssh_port=ns.ssh_port,
        ssh_identity_file=ns.ssh_identity_file,
        mpi=ns.mpi,
        nics=nics,
        start_timeout=ns.start_timeout,
        env=tuple(_knobs(ns)),
        verbose=ns.verbose,
        spark=ns.spark,
        master=ns.master,
        ray=ns.ray,
        address=ns.address,
        **elastic,
    )


_PYTHON = re.compile(r"python(\d+(\.\d+)*)?")


def through_guard(command: tuple[str, ...]) -> tuple[str, ...]:
    """``python train.py ARGS`` with this interpreter runs as ``python -m
    ringcore.launch.script train.py ARGS``: the same script, ``sys.argv``, ``__main__``
    and ``sys.path[0]``, with the launchers' guard on ``init_process_group`` installed
    first (a program's own env:// group on the interface that reaches the other hosts,
    each group of the process at fresh rendezvous keys, a disagreeing ``rank=`` /
    ``world_size=`` named). Any other command runs as it is: another interpreter (this
    one's path, as ``which`` finds it, is compared: another environment may lack
    ringtrain), options before the script, a program that is not Python."""
    if len(command) < 2 or not command[1].endswith(".py"):
        return command
    if not _PYTHON.fullmatch(os.path.basename(command[0])):
        return command
    found = shutil.which(command[0])
    if found is None or os.path.abspath(found) != os.path.abspath(sys.executable):
        return command
    return (command[0], "-m", "ringcore.launch.script", *command[1:])
