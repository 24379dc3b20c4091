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

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Sequence
from typing import IO, Any

from .._config import STORE_EXTERNAL_ENV_VAR
from .._errors import CommandFailedError

__all__ = [
    "TERM_GRACE_S",
    "ShippedScript",
    "check_script",
    "die_with_parent",
    "end_group",
    "is_script",
    "run_command",
    "script_command",
    "signal_group",
]

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


def is_script(program: Any) -> bool:
    """Whether ``program`` names a file to run (a str or a path) rather than a function."""
    return isinstance(program, str | os.PathLike)


class ShippedScript:
    """A Python file with its arguments and the driver's bytes of it: what a launcher
    sends its workers to run. Called on a worker, it runs the file in place (its folder
    first on ``sys.path``, so modules beside it import) when the driver's path holds the
    same bytes there (the same machine, a shared file system), else from a temporary copy
    of the driver's bytes, removed afterwards (only the file travels); in a process of
    its own (:func:`script_command`, :func:`run_command`); None, or
    :class:`CommandFailedError` with the script's exit status."""

    def __init__(self, path: str, args: Sequence[str], source: bytes):
        self.path, self.args, self.source = path, tuple(args), source
        self.__name__ = self.name  # what a launcher names its job by

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    @classmethod
    def from_driver(cls, path: Any, args: Any = (), kwargs: Any = None) -> ShippedScript:
        """Checked on the driver, before any job (:func:`check_script`); ``kwargs``,
        what a function would take, is refused."""
        if kwargs:
            raise TypeError(
                f"kwargs={kwargs!r} cannot reach the script {os.fspath(path)!r}: a script "
                "takes command-line arguments only; pass them as args=['--name', 'value', ...]"
            )
        checked, arg_list = check_script(path, () if args is None else args)
        with open(checked, "rb") as f:
            return cls(checked, arg_list, f.read())

    def __call__(self) -> None:
        if self._here():
            run_command(script_command(self.path, self.args))
            return None
        folder = tempfile.mkdtemp(prefix="ringtrain-script-")
        try:
            copy = os.path.join(folder, self.name)
            with open(copy, "wb") as f:
                f.write(self.source)
            run_command(script_command(copy, self.args))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return None

    def _here(self) -> bool:
        try:
            with open(self.path, "rb") as f:
                return f.read() == self.source
        except OSError:  # not on this machine
            return False


def script_command(path: str, args: Sequence[str]) -> list[str]:
    """The command that runs the Python file ``path`` with ``args`` in this interpreter."""
    return [sys.executable, "-m", "ringcore.launch.script", path, *args]


def die_with_parent() -> None:
    """In a launched process, before it runs: SIGTERM when the thread that started it
    ends (``PR_SET_PDEATHSIG``); a no-op where that does not exist."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup ends it
        pass


def signal_group(pid: int, sig: int) -> bool:
    """Send ``sig`` to the process group ``pid`` leads; False when it is gone."""
    try:
        os.killpg(pid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def end_group(proc: subprocess.Popen, sig: int = signal.SIGTERM, grace_s: float = TERM_GRACE_S):
    """``sig`` to ``proc``'s whole group (what it started too), SIGKILL to what is left of
    the group after ``grace_s``."""
    if signal_group(proc.pid, sig):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(grace_s)
    if signal_group(proc.pid, signal.SIGKILL):
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(5.0)


def _copy(source: IO[bytes], sink: Any) -> None:
    for raw in iter(source.readline, b""):
        sink.write(raw.decode("utf-8", "replace"))
        sink.flush()
    source.close()


def run_command(
    argv: Sequence[str], env: dict[str, str] | None = None, cwd: str | None = None
) -> int:
    """Run ``argv`` with this process's environment (updated by ``env``), its output
    lines copied to ``sys.stdout`` / ``sys.stderr``; returns 0, or raises
    :class:`CommandFailedError` with the command's exit status.

    The command runs inside a worker whose job's store is already up (a launcher's
    worker, or its driver, hosts it), so it gets ``RING_STORE_EXTERNAL=1``: a
    ``ringcore.init()`` in it on rank 0 connects to that store instead of binding its
    port a second time."""
    argv = [str(a) for a in argv]
    proc = subprocess.Popen(
        argv,
        env={**os.environ, STORE_EXTERNAL_ENV_VAR: "1", **(env or {})},
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        preexec_fn=die_with_parent,
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
        end_group(proc)
        raise
    finally:
        for t in copiers:
            t.join(5.0)
    if code != 0:
        raise CommandFailedError(argv, code)
    return 0
