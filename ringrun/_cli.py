"""``ringrun``'s entry point: parse, check, then run the job one of four ways."""

from __future__ import annotations

import signal
import sys
import threading

from ringcore import RingError

from ._args import Options, UsageError, parse

__all__ = ["main"]


def _run(opts: Options) -> int:
    if opts.spark:
        from ._clusters import run_on_spark

        return run_on_spark(opts)
    if opts.ray:
        from ._clusters import run_on_ray

        return run_on_ray(opts)
    if opts.elastic:
        from ._elastic import run_elastic

        return run_elastic(opts)
    if opts.mpi:
        from ._clusters import run_mpi

        return run_mpi(opts)
    from ._hosts_run import run_hosts

    return run_hosts(opts)


def main(argv: list[str] | None = None) -> int:
    """Run ``ringrun ARGS`` (``argv``: without the program name; None: ``sys.argv[1:]``)
    and return its exit status: 0, the first failing rank's own status, 2 for a command
    line refused before anything started, 130 / 143 after Ctrl-C / SIGTERM.

    SIGINT is ringrun's to handle even when the shell that started it ignored it (a
    background job of a script: ``ringrun ... &``): a SIGINT sent to ringrun ends the job
    as Ctrl-C does, never leaving it running with its ranks."""
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    if ignored and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return _run(parse(sys.argv[1:] if argv is None else list(argv)))
    except UsageError as exc:
        print(f"ringrun: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except RingError as exc:
        print(f"ringrun: {exc}", file=sys.stderr, flush=True)
        return 1
