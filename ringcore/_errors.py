"""The one exception tree of ringtrain.

::

    RingError
    ├── NotInitializedError        ringcore used before init()
    ├── RendezvousError            the ranks could not find each other
    ├── RingInternalError          a collective could not complete (alias HorovodInternalError)
    ├── CollectiveMismatchError    ranks disagree on a collective (shape, dtype, op, root);
    │                              also a RuntimeError (as Horovod) and a ValueError
    ├── WorkerError                a worker raised; carries its rank, host and traceback
    ├── CommandFailedError         a worker's command (a script) exited with a non-zero code
    ├── GpuUnavailableError        GPU work asked for without a usable CUDA device
    └── StackError                 installed packages that do not work together

Every exception pickles with its fields intact (``__reduce__``) so that a worker's
failure reaches the driver unchanged.
"""

from __future__ import annotations

__all__ = [
    "CollectiveMismatchError",
    "CommandFailedError",
    "GpuUnavailableError",
    "HorovodInternalError",
    "NotInitializedError",
    "RendezvousError",
    "RingError",
    "RingInternalError",
    "StackError",
    "WorkerError",
]


class RingError(Exception):
    """Root of every exception raised by ringtrain."""

    def __reduce__(self):  # keep the message through pickling
        return (type(self), self.args)


class NotInitializedError(RingError, ValueError):
    def __init__(self, message: str = "ringcore is not initialized; call init() first"):
        super().__init__(message)


class RendezvousError(RingError):
    pass


class RingInternalError(RingError):
    pass


HorovodInternalError = RingInternalError


class CollectiveMismatchError(RingError, RuntimeError, ValueError):
    """As Horovod, a disagreement between ranks is a ``RuntimeError`` (what its users
    catch); it stays a ``ValueError`` for code written against earlier ringcore."""


class StackError(RingError, ImportError):
    pass


class GpuUnavailableError(RingError):
    """GPU work was asked for where this process has no usable CUDA device
    (``ringcore.launch`` exports it to the launchers)."""


class WorkerError(RingError):
    """A worker's function raised. ``rank``, ``host``, ``traceback`` tell where and what;
    ``output`` holds the last lines the worker printed, when the runner captured them.
    ``exit_code``: the worker's own exit status when it ended by one (a script that
    exited non-zero, ``sys.exit(n)`` in a function), else None; ``ringrun`` exits with it."""

    def __init__(
        self,
        rank: int,
        host: str,
        error_type: str,
        message: str,
        traceback: str = "",
        output: str = "",
        exit_code: int | None = None,
    ):
        self.rank = rank
        self.exit_code = exit_code
        self.host = host
        self.error_type = error_type
        self.message = message
        self.traceback = traceback
        self.output = output
        text = f"rank {rank} on host {host} raised {error_type}: {message}"
        if traceback:
            text += f"\n\nTraceback of rank {rank}:\n{traceback.rstrip()}"
        if output:
            text += f"\n\nLast output of rank {rank}:\n{output.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (
            type(self),
            (
                self.rank,
                self.host,
                self.error_type,
                self.message,
                self.traceback,
                self.output,
                self.exit_code,
            ),
        )

    @classmethod
    def from_exception(cls, rank: int, host: str, exc: BaseException) -> WorkerError:
        import traceback as tb

        text = "".join(tb.format_exception(type(exc), exc, exc.__traceback__))
        return cls(rank, host, type(exc).__name__, str(exc), text, exit_code=_exit_code(exc))


def _exit_code(exc: BaseException) -> int | None:
    """The exit status ``exc`` stands for: a failed command's, or ``sys.exit(n)``'s."""
    if isinstance(exc, CommandFailedError):
        return exc.exit_code
    if isinstance(exc, SystemExit):
        code = exc.code
        return code if isinstance(code, int) else (0 if code is None else 1)
    return None


class CommandFailedError(RingError):
    """A worker's command (a script a launcher ran for the user) exited with
    ``exit_code`` (a negative code: ended by that signal)."""

    def __init__(self, argv: list[str], exit_code: int):
        self.argv = list(argv)
        self.exit_code = exit_code
        how = (
            f"was ended by signal {-exit_code}"
            if exit_code < 0
            else f"exited with code {exit_code}"
        )
        super().__init__(f"the command {' '.join(self.argv)!s} {how}")

    def __reduce__(self):
        return (type(self), (self.argv, self.exit_code))
