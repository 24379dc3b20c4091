"""How ``ringcore.testing.run_workers`` starts its rank processes: forked from a fork
server that has torch and ``ringcore.torch`` imported already.

A spawned rank starts a fresh interpreter and imports torch (about 1.2 s of one core
here); a rank forked from the server starts with them loaded: a 2-rank
``run_workers`` of one allreduce took ~3.5 s spawned and ~0.5 s forked on this
project's 2-core machine. The server is started once per process, at the first call,
and lives until that process exits.

What a rank inherits is what it would inherit if spawned now, not what the server had
when it started: the caller's environment (``os.environ`` at the call), its working
directory, and its stdout and stderr (the file descriptors, so a test that captures
them sees the ranks' output). ``RING_RANK_START=spawn`` starts every rank as a fresh
interpreter instead (slower; what a rank imports then runs under the caller's
environment).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
from multiprocessing import reduction
from typing import Any

from . import _config as cfg

PRELOAD = ["torch", "ringcore.torch"]

_contexts: dict[str, Any] = {}


def context() -> Any:
    """The multiprocessing context ranks start from (``RING_RANK_START``: ``forkserver``,
    the default, or ``spawn``)."""
    method = os.environ.get(cfg.RANK_START_ENV_VAR, "forkserver") or "forkserver"
    if method not in ("forkserver", "spawn"):
        raise ValueError(
            f"{cfg.RANK_START_ENV_VAR}={method!r} is not a way to start ranks; use forkserver "
            "(the default) or spawn"
        )
    if method not in _contexts:
        ctx = multiprocessing.get_context(method)
        if method == "forkserver":
            ctx.set_forkserver_preload(PRELOAD)
        _contexts[method] = ctx
    return _contexts[method]


class _Fd:
    """A file descriptor of the caller, handed to the rank when it starts (the fork
    server passes it over its Unix socket; spawn inherits it)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_detach, (reduction.DupFd(self.fd),))


def _detach(dup: Any) -> int:
    return dup.detach()


def _enter(target: Any, args: tuple, env: dict[str, str], cwd: str, out: int, err: int) -> None:
    os.environ.clear()
    os.environ.update(env)
    with contextlib.suppress(OSError):  # the caller's folder is gone: stay where we are
        os.chdir(cwd)
    for fd, std in ((out, 1), (err, 2)):
        if fd != std:
            os.dup2(fd, std)
    for fd in {out, err} - {1, 2}:
        os.close(fd)
    target(*args)


def process(ctx: Any, target: Any, args: tuple, env: dict[str, str], name: str) -> Any:
    """A rank process (not started) that runs ``target(*args)`` with the caller's
    environment updated by ``env``, its working directory, stdout and stderr."""
    return ctx.Process(
        target=_enter,
        args=(target, args, {**os.environ, **env}, os.getcwd(), _Fd(1), _Fd(2)),
        daemon=True,
        name=name,
    )
