"""A Python file as ``spark_runner.run``'s program: ``run("train.py", args=["--lr", "0.1"])``.

The driver checks the file and its arguments before any job and reads it
(``ringcore.launch.ShippedScript``: it exists, it is ``.py``, every argument is a
string); the task runs it as torchrun would, in a process of its own (``python -m
ringcore.launch.script PATH ARGS``, so ``__name__ == "__main__"`` and ``sys.argv`` are the
script's) with the task's environment: the ``RING_*`` variables and torchrun's ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``... Its output reaches the driver like a
function's, prefixed by rank; a non-zero exit is a :class:`ringcore.WorkerError` whose
``exit_code`` is the script's. Each rank's result is None. The driver's bytes travel
with the task: the file runs in place where the worker holds the same bytes at that
path (the same machine, a shared file system), else from a temporary copy (only the file
itself travels: the modules it imports must be installed on the workers).
"""

from __future__ import annotations

from typing import Any

from ringcore.launch import ShippedScript, is_script

__all__ = ["as_program"]


def as_program(program: Any, args: Any, kwargs: Any) -> tuple[Any, tuple, dict]:
    """``(fn, args, kwargs)`` for ``run``: a script becomes a
    :class:`~ringcore.launch.ShippedScript` (checked here, before any job: the file and
    its arguments); a function passes through."""
    if not is_script(program):
        return program, tuple(args), dict(kwargs or {})
    return ShippedScript.from_driver(program, args, kwargs), (), {}
