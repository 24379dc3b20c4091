"""Programs a launcher runs as they are: a Python file with its arguments, or any command.

A launcher's worker runs a user's script as torchrun would: a process of its own
(``python -m ringcore.launch.script PATH ARGS``: the script's ``sys.argv``, its folder
first on ``sys.path``, ``__name__ == "__main__"``), with the worker's environment — the
``RING_*`` variables and torchrun's. :func:`run_command` copies the command's output
lines to this process's ``sys.stdout`` / ``sys.stderr`` (which a launcher forwards,
prefixed by rank) and raises :class:`CommandFailedError` with its exit status when it
fails. The command dies with its worker: it is started in a process group of its own
and told to end when the worker's thread does (``PR_SET_PDEATHSIG``), and a worker
that is interrupted ends the command's whole group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import IO, Any

from .._errors import CommandFailedError

__all__ = ["check_script", "run_command", "script_command"]

#: how long a command has to exit after SIGTERM before it is killed
TERM_GRACE_S = 5.0


def check_script(path: Any, args: Any = ()) -> tuple[str, list[str]]:
    """``(path, args)`` of a Python file to run, checked before any job starts: the file
    exists and is Python (``.py``), every argument is a string."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"the script must be a path to a Python file, got {type(path).__name__}")
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"the script {path!r} does not exist (from {os.getcwd()!r}); pass the path of "
            "a Python file, absolute or relative to the working directory"
        )
    if not path.endswith(".py"):
        raise ValueError(
            f"the script {path!r} is not a Python file (.py); pass a Python file, or a "
            "function to run"
        )
    if isinstance(args, str | bytes):
        raise TypeError(
            f"the script's arguments must be a list of strings, got the string {args!r}"
        )
    args = list(args)
    for i, a in enumerate(args):
        if not isinstance(a, str):
            raise TypeError(
                f"argument {i} of the script {path!r} is {a!r} ({type(a).__name__}); every "
                f"argument must be a string, as on a command line: pass str({a!r})"
            )
    return os.path.abspath(path), args


def script_command(path: str, args: Sequence[str]) -> list[str]:
    """The command that runs the Python file ``path`` with ``args`` in this interpreter."""
    return [sys.executable, "-m", "ringcore.launch.script", path, *args]


def _die_with_parent() -> None:
    """In the command's process, before it runs: end it when its parent thread does."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the worker's own cleanup ends it
        pass


def _copy(source: IO[bytes], sink: Any) -> None:
    for raw in iter(source.readline, b""):
        sink.write(raw.decode("utf-8", "replace"))
        sink.flush()
    source.close()


def _end_group(proc: subprocess.Popen) -> None:
    for sig, wait_s in ((signal.SIGTERM, TERM_GRACE_S), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_command(
    argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> int:
    """Run ``argv`` with this process's environment (updated by ``env``), its output
    lines copied to ``sys.stdout`` / ``sys.stderr``; returns 0, or raises
    :class:`CommandFailedError` with the command's exit status."""
    argv = [str(a) for a in argv]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=_die_with_parent,
    )
    copiers = [
        threading.Thread(target=_copy, args=(proc.stdout, sys.stdout), daemon=True),
        threading.Thread(target=_copy, args=(proc.stderr, sys.stderr), daemon=True),
    ]
    for t in copiers:
        t.start()
    try:
        code = proc.wait()
    except BaseException:  # interrupted (Ctrl-C, the task killed): end its whole group
        _end_group(proc)
        raise
    finally:
        for t in copiers:
            t.join(5.0)
    if code != 0:
        raise CommandFailedError(argv, code)
    return 0
