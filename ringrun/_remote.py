"""One rank on another host: what ``ssh host python -m ringrun._remote`` runs there.

ringrun sends the rank over ssh's standard input, never on a command line (the job's
secret would show in ``ps``): one JSON line ``{"cwd", "env", "argv"}``. This process
starts ``argv`` in ``cwd`` with its environment updated by ``env``, in a process group of
its own, its output going straight to ssh's. Then it keeps reading its standard input:
a line ``INT`` or ``TERM`` sends that signal to the rank's whole group; end of input
(ringrun closed it, or died, or the connection dropped) ends the group: SIGTERM, then
SIGKILL after ``TERM_GRACE_S``. It exits with the rank's status (``128 + N`` for a
rank ended by signal N), which ssh hands back to ringrun.

``python -m ringrun._remote --free-port`` prints a TCP port free on this host (the
job's ``MASTER_PORT`` when rank 0 is remote). The process groups are ended with
``ringcore.launch``'s helpers (:func:`~ringcore.launch.end_group`), as a launcher's
worker ends a command's.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading

from ringcore.launch import die_with_parent, end_group, free_port, signal_group

__all__ = ["exit_status", "main"]

SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM}


def exit_status(code: int) -> int:
    """A process's exit status as a shell reports it: ``128 + N`` when signal N ended it."""
    return 128 - code if code < 0 else code


def _watch_input(proc: subprocess.Popen) -> None:
    for line in sys.stdin:
        sig = SIGNALS.get(line.strip())
        if sig is not None:
            signal_group(proc.pid, sig)
    end_group(proc)  # ringrun closed our input, or went away


def main() -> int:
    if sys.argv[1:] == ["--free-port"]:
        print(free_port(), flush=True)
        return 0
    spec = json.loads(sys.stdin.readline())
    host = socket.gethostname()
    try:
        os.chdir(spec["cwd"])
    except OSError as exc:
        print(f"ringrun: on {host}: cannot enter {spec['cwd']!r}: {exc}", file=sys.stderr)
        return 127
    try:
        proc = subprocess.Popen(
            spec["argv"],
            env={**os.environ, **spec["env"]},
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    except OSError as exc:
        print(f"ringrun: on {host}: cannot start {spec['argv'][0]!r}: {exc}", file=sys.stderr)
        return 127
    threading.Thread(target=_watch_input, args=(proc,), daemon=True).start()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: signal_group(proc.pid, signum))
    return exit_status(proc.wait())


if __name__ == "__main__":
    raise SystemExit(main())
