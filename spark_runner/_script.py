"""A Python file as ``spark_runner.run``'s program: ``run("train.py", args=["--lr", "0.1"])``.

The driver checks the file and its arguments before any job (``check_script``: it
exists, it is ``.py``, every argument is a string) and reads it; the task runs it as
torchrun would, in a process of its own (``python -m ringcore.launch.script PATH ARGS``,
so ``__name__ == "__main__"`` and ``sys.argv`` are the script's) with the task's
environment: the ``RING_*`` variables and torchrun's ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT``... Its output reaches the driver like a function's,
prefixed by rank; a non-zero exit is a :class:`ringcore.WorkerError` whose
``exit_code`` is the script's. Each rank's result is None.

Which copy runs: the driver's bytes travel with the task. Where the driver's path holds
the same bytes on the worker (the same machine, a shared file system) the file runs in
place, so the modules beside it import as they do on the driver; anywhere else the
driver's copy is written to a temporary folder (removed afterwards) and runs from
there: only the file itself travels, the modules it imports must be installed on the
workers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

from ringcore.launch import (
    STORE_EXTERNAL_ENV_VAR,
    check_script,
    run_command,
    script_command,
)

__all__ = ["ScriptRun", "as_program", "is_script"]


def is_script(program: Any) -> bool:
    """Whether ``program`` names a file (a str or a path) rather than a function."""
    return isinstance(program, str | os.PathLike)


class ScriptRun:
    """The task's function for a script: runs the file with its arguments; returns None."""

    def __init__(self, path: str, args: list[str], source: bytes):
        self.path, self.args, self.source = path, list(args), source
        self.__name__ = os.path.basename(path)

    def __call__(self) -> None:
        with self._local_copy() as path:
            # the task hosts the job's store (rank 0): the script's ringcore.init(), if it
            # calls one, connects to it instead of binding its port a second time
            run_command(script_command(path, self.args), env={STORE_EXTERNAL_ENV_VAR: "1"})
        return None

    @contextlib.contextmanager
    def _local_copy(self) -> Iterator[str]:
        """The driver's path when it holds the driver's bytes here, else a temporary copy."""
        if _read(self.path) == self.source:
            yield self.path
            return
        folder = tempfile.mkdtemp(prefix="ringtrain-script-")
        try:
            path = os.path.join(folder, os.path.basename(self.path))
            with open(path, "wb") as f:
                f.write(self.source)
            yield path
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # not on this machine
        return None


def as_program(program: Any, args: Any, kwargs: Any) -> tuple[Any, tuple, dict]:
    """``(fn, args, kwargs)`` for ``run``: a script becomes a :class:`ScriptRun` (checked
    here, before any job: the file and its arguments); a function passes through."""
    if not is_script(program):
        return program, tuple(args), dict(kwargs or {})
    if kwargs:
        raise TypeError(
            f"kwargs={kwargs!r} with the script {os.fspath(program)!r}: a script takes only "
            "args, a list of strings (its command line); pass them as args=[...]"
        )
    path, checked = check_script(program, args)
    with open(path, "rb") as f:
        source = f.read()
    return ScriptRun(path, checked, source), (), {}
