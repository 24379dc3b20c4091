"""A Python file run on every rank, as torchrun runs it: ``RayExecutor.run("train.py",
args=[...])`` and ``RingTrainer("train.py", script_args=[...])``.

The driver checks the file and its arguments before any actor starts
(``ringcore.launch.check_script``) and reads the file's bytes into a :class:`Script`,
plain data that travels to the actors with the call. On an actor the script runs in
place (its own folder first on ``sys.path``, so its sibling modules import) when the
same path on that node holds the same bytes; otherwise the driver's bytes run from a
temporary copy, removed afterwards (only the file itself travels: a script that imports
a module beside it needs that folder on every node). It runs in a process of its own
(``ringcore.launch.script_command``) with the actor's environment — the ``RING_*``
variables and torchrun's — its output forwarded as the actor's own is; the rank's
result is None, and a non-zero exit reaches the driver as a ``WorkerError`` whose
``exit_code`` is the script's.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any

from ringcore.launch import check_script, run_command, script_command

__all__ = ["Script", "is_script"]


def is_script(what: Any) -> bool:
    """Whether ``what`` names a file to run (a path) rather than a function."""
    return isinstance(what, str | os.PathLike)


@dataclass(frozen=True)
class Script:
    """A Python file and its arguments, with the driver's bytes of the file."""

    path: str  # absolute, on the driver
    args: tuple[str, ...]
    source: bytes

    @classmethod
    def from_driver(cls, path: Any, args: Any, kwargs: Any = None) -> Script:
        """Checked on the driver: the file exists and is Python, every argument a string
        (``kwargs``: what a function would take, refused)."""
        if kwargs:
            raise TypeError(
                f"kwargs={kwargs!r} cannot reach the script {os.fspath(path)!r}: a script takes "
                "command-line arguments only; pass them as args=['--name', 'value', ...]"
            )
        checked, arg_list = check_script(path, () if args is None else args)
        with open(checked, "rb") as f:
            return cls(checked, tuple(arg_list), f.read())

    @property
    def name(self) -> str:
        return os.path.basename(self.path)

    def __call__(self) -> None:
        """Run the script on this rank; None, or ``CommandFailedError`` with its exit code."""
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
        """The same path on this node holds the driver's bytes."""
        try:
            with open(self.path, "rb") as f:
                return f.read() == self.source
        except OSError:
            return False
