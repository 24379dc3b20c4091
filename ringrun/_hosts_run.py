"""``ringrun -np N [-H host:slots,...] command``: ringrun starts every rank itself.

ringrun hosts the job's key-value store (a ``TCPStore`` server in this process, which
outlives every rank) and gives each rank the ``RING_*`` variables (:func:`worker_env`,
with ``RING_STORE_EXTERNAL=1`` and the job's ``RING_SECRET_KEY``), torchrun's
(:func:`torchrun_env`) and the knobs of Horovod's flags. Ranks are numbered host by host
in the order ``-H`` gives the hosts. The store's address: ``127.0.0.1`` when every rank
runs here, else this machine's address on the route to the first other host (or the
address of ``--network-interface``'s first interface). ``MASTER_PORT`` (the user's own
process group) is a port free on rank 0's host: picked here when rank 0 runs here, else
asked of rank 0's host over ssh (:func:`ringrun._ssh.remote_free_port`).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import uuid
from collections.abc import Callable
from typing import Any

from ringcore import topology_from_hosts
from ringcore.launch import (
    free_port,
    new_secret,
    nics_env,
    start_store_server,
    stop_store_server,
    torchrun_env,
    worker_env,
)

from ._args import Options, UsageError, rank_hosts
from ._ranks import Job, Rank
from ._ssh import interface_address, is_local, remote_free_port, route_address, ssh_command

__all__ = ["base_env", "check_command", "guarded", "run_hosts", "say", "start_rank"]

_LOOPBACK = "127.0.0.1"
# not sent to other hosts: they have their own (as horovodrun leaves them out)
_LOCAL_ONLY = ("HOSTNAME", "HOME", "USER", "LOGNAME", "SHELL", "PWD", "OLDPWD", "SHLVL",
               "TERM", "DISPLAY", "MAIL", "_", "LS_COLORS", "TMPDIR")  # fmt: skip
_LOCAL_ONLY_PREFIXES = ("SSH_", "XDG_", "BASH_FUNC_")


class Stopped(Exception):
    """ringrun itself got SIGTERM or SIGHUP."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: Any) -> None:
    raise Stopped(signum)


def say(opts: Options, text: str) -> None:
    if opts.verbose:
        print(f"ringrun: {text}", file=sys.stderr, flush=True)


def check_command(command: tuple[str, ...]) -> None:
    program = command[0]
    if os.sep in program:
        found = os.path.isfile(program) and os.access(program, os.X_OK)
    else:
        found = shutil.which(program) is not None
    if not found:
        raise UsageError(
            f"the command {program!r} is not an executable file here (PATH="
            f"{os.environ.get('PATH', '')}); check its name, e.g. ringrun -np 2 python train.py"
        )


def _forwarded(env: dict[str, str]) -> dict[str, str]:
    return {
        k: v
        for k, v in env.items()
        if k not in _LOCAL_ONLY and not k.startswith(_LOCAL_ONLY_PREFIXES)
    }


def base_env(opts: Options) -> dict[str, str]:
    """What every rank's environment gets beside its place: the knobs, the interfaces."""
    env = {"PYTHONUNBUFFERED": os.environ.get("PYTHONUNBUFFERED", "1")}
    env.update(opts.env)
    env.update(nics_env(opts.nics or None))
    return env


def start_rank(opts: Options, label: int, host: str, local: bool, env: dict[str, str]) -> Rank:
    """Start the command as rank (or worker) ``label`` on ``host``: here, or through ssh
    with the command, working directory and environment on ssh's input."""
    if local:
        say(opts, f"rank {label}: {host} (this host)")
        return Rank(label, host, opts.command, {**os.environ, **env})
    remote_argv = [sys.executable, "-m", "ringrun._remote"]
    argv = ssh_command(host, opts.ssh_port, opts.ssh_identity_file, remote_argv)
    say(opts, f"rank {label}: {host} through {argv[0]}")
    spec = {"cwd": os.getcwd(), "env": {**_forwarded(dict(os.environ)), **env},
            "argv": list(opts.command)}  # fmt: skip
    return Rank(label, host, argv, None, remote_spec=spec)


class _Plan:
    """Where each rank runs and how the ranks find each other."""

    def __init__(self, opts: Options):
        self.hosts = rank_hosts(opts.hosts, opts.np) if opts.hosts else [_LOOPBACK] * opts.np
        unique = list(dict.fromkeys(self.hosts))
        self.local = {h: is_local(h) for h in unique}
        remote = [h for h in unique if not self.local[h]]
        if any(self.local.values()):
            check_command(opts.command)
        if not remote:
            self.store_addr = _LOOPBACK
        else:  # --network-interface's address when this host has it, else the route's
            own = [a for a in map(interface_address, opts.nics) if a]
            self.store_addr = own[0] if own else route_address(remote[0])
        first = self.hosts[0]
        timeout = opts.start_timeout or 60.0
        if self.local[first]:
            self.master_addr, self.master_port = self.store_addr, free_port()
        else:
            port = remote_free_port(first, opts.ssh_port, opts.ssh_identity_file, timeout)
            self.master_addr, self.master_port = first, port

    def rank_env(self, opts: Options, r: int, store_port: int, secret: str, run_id: str):
        topology = topology_from_hosts(self.hosts, r)
        env = base_env(opts)
        env.update(
            worker_env(topology, self.store_addr, store_port, external_store=True, secret=secret)
        )
        env.update(torchrun_env(topology, self.master_addr, self.master_port, run_id))
        return env


def _start(opts: Options, plan: _Plan, job: Job, store_port: int) -> None:
    secret, run_id = new_secret(), uuid.uuid4().hex
    for r, host in enumerate(plan.hosts):
        env = plan.rank_env(opts, r, store_port, secret, run_id)
        job.add(start_rank(opts, r, host, plan.local[host], env))


def run_hosts(opts: Options) -> int:
    """Run the job; ringrun's exit status (the first failing rank's own)."""
    plan = _Plan(opts)  # every check before anything starts
    job = Job()

    def body(port: int) -> int:
        say(opts, f"the job's store: {plan.store_addr}:{port}; MASTER_ADDR "
                   f"{plan.master_addr}:{plan.master_port}")  # fmt: skip
        _start(opts, plan, job, port)
        return job.wait()

    return guarded(opts, job, body)


def guarded(opts: Options, job: Job, body: Callable[[int], int]) -> int:
    """Host the job's store and run ``body(store_port)``, ending every rank on Ctrl-C,
    SIGTERM or SIGHUP (exit status 128 + N) and when a rank's process cannot start."""
    previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGHUP, _stop)
    try:
        return body(start_store_server("0.0.0.0", opts.np, opts.start_timeout))
    except KeyboardInterrupt:
        return _interrupted(job, signal.SIGINT)
    except Stopped as stop:
        return _interrupted(job, stop.signum)
    except OSError as exc:  # a rank's process could not start
        print(f"ringrun: could not start rank {len(job.ranks)}: {exc}", file=sys.stderr)
        job.end(signal.SIGTERM)
        return 127
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        stop_store_server()


def _interrupted(job: Job, signum: int) -> int:
    for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)  # a second Ctrl-C does not cut the clean-up short
    name = signal.Signals(signum).name
    print(f"ringrun: {name}: ending every rank", file=sys.stderr, flush=True)
    job.end(signum)
    return 128 + signum
