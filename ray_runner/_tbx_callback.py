"""``TBXLoggerCallback``: TensorBoard event files of a RingTrainer run, written by the driver.

Ray Tune's ``ray.tune.logger.TBXLoggerCallback`` under the same name::

    RunConfig(callbacks=[TBXLoggerCallback()])   # then: tensorboard --logdir <run folder>

Every report of rank 0 becomes scalars as it reaches the driver: one per number of the
report (nested dicts flattened with ``/``), tagged with the metric's name, at step = the
report's number (from 1, Ray's ``training_iteration``). The event file goes into the run
folder (``<storage_path>/<name>/``) or into ``logdir`` when given (a local folder). When
the run folder is in remote storage (``s3://...``), the file is written to a local
temporary folder and uploaded into the run folder through the run's filesystem at most
every ``upload_interval_s`` seconds and when the run ends. Needs ``tensorboardX``
(``pip install 'ringtrain[tensorboard]'``). The event file is the run-services layer's
:class:`ringcore.runs.EventWriter`, as the estimators' rank 0 writes its scalars, and
:func:`ringcore.runs.read_scalars` reads the files back.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

from ringcore.runs import EventWriter, numeric

from ._callbacks import Callback

__all__ = ["TBXLoggerCallback", "bind_storage"]

#: a remote run folder gets the event file at most this often (and at the end)
UPLOAD_INTERVAL_S = 30.0


class TBXLoggerCallback(Callback):
    """Rank 0's reports as TensorBoard scalars (see the module docstring)."""

    def __init__(
        self,
        logdir: str | os.PathLike | None = None,
        *,
        upload_interval_s: float = UPLOAD_INTERVAL_S,
    ):
        if logdir is not None and not isinstance(logdir, (str, os.PathLike)):
            raise ValueError(
                f"TBXLoggerCallback(logdir={logdir!r}): pass a local folder path, or None for "
                "the run folder"
            )
        if (
            isinstance(upload_interval_s, bool)
            or not isinstance(upload_interval_s, (int, float))
            or upload_interval_s < 0
        ):
            raise ValueError(
                f"TBXLoggerCallback(upload_interval_s={upload_interval_s!r}): pass seconds >= 0"
            )
        try:
            import tensorboardX  # noqa: F401
        except ImportError as exc:
            raise ImportError(
                "TBXLoggerCallback needs tensorboardX on the driver; "
                "pip install 'ringtrain[tensorboard]'"
            ) from exc
        self.logdir = None if logdir is None else os.path.abspath(os.fspath(logdir))
        self.upload_interval_s = float(upload_interval_s)
        self._filesystem: Any = None  # the run's (bind_storage); None: this machine's disk
        self._writer: EventWriter | None = None
        self._step = 0
        self._uploaded = 0.0

    @property
    def folder(self) -> str | None:
        """The local folder the event file is written to (None before the run starts)."""
        return None if self._writer is None else self._writer.folder

    def on_start(self, *, name: str, path: str, config: dict | None) -> None:
        import pyarrow.fs as pafs

        self._close()
        self._step = 0
        remote = self._filesystem is not None and not isinstance(
            self._filesystem, pafs.LocalFileSystem
        )
        if self.logdir is not None:
            self._writer = EventWriter(self.logdir)
        elif remote:
            self._writer = EventWriter(upload=self._uploader(path))
        else:
            self._writer = EventWriter(path)
        self._uploaded = time.monotonic()

    def _uploader(self, run_dir: str) -> Any:
        filesystem = self._filesystem

        def upload(name: str, data: bytes) -> None:
            with filesystem.open_output_stream(f"{run_dir}/{name}") as out:
                out.write(data)

        return upload

    def on_report(self, metrics: dict, checkpoint: Any) -> None:
        assert self._writer is not None  # on_start came first
        self._step += 1
        for tag, value in numeric(metrics).items():
            self._writer.add(tag, value, self._step)
        if self._writer.uploads and time.monotonic() - self._uploaded >= self.upload_interval_s:
            self._uploaded = time.monotonic()
            self._writer.flush()

    def _close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def on_end(self, result: Any) -> None:
        self._close()

    def on_error(self, error: BaseException) -> None:
        self._close()


def bind_storage(callbacks: Iterable[Any], filesystem: Any) -> None:
    """Hand the run's filesystem to the callbacks that write into the run folder."""
    for callback in callbacks:
        if isinstance(callback, TBXLoggerCallback):
            callback._filesystem = filesystem
