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
(``pip install 'ringtrain[tensorboard]'``); ``estimators.read_tensorboard_scalars``'s
reader (:func:`estimators.tracking._tensorboard.read_scalars`) reads the files back.
"""

from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time
from collections.abc import Iterable
from typing import Any

from ._callbacks import Callback
from ._mlflow_callback import numeric

__all__ = ["TBXLoggerCallback", "bind_storage"]

EVENT_GLOB = "events.out.tfevents.*"
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
        self._writer: Any = None
        self._tmp: str | None = None
        self._remote_dir: str | None = None
        self._step = 0
        self._uploaded = 0.0

    @property
    def folder(self) -> str | None:
        """The local folder the event file is written to (None before the run starts)."""
        return None if self._writer is None else self._writer.logdir

    def on_start(self, *, name: str, path: str, config: dict | None) -> None:
        import pyarrow.fs as pafs
        from tensorboardX import SummaryWriter

        self._close()
        self._step = 0
        remote = self._filesystem is not None and not isinstance(
            self._filesystem, pafs.LocalFileSystem
        )
        if self.logdir is not None:
            folder = self.logdir
        elif remote:
            folder = self._tmp = tempfile.mkdtemp(prefix="ringtrain-tbx-")
            self._remote_dir = path
        else:
            folder = path
        os.makedirs(folder, exist_ok=True)
        self._writer = SummaryWriter(logdir=folder, flush_secs=30)
        self._uploaded = time.monotonic()

    def on_report(self, metrics: dict, checkpoint: Any) -> None:
        self._step += 1
        for tag, value in numeric(metrics).items():
            self._writer.add_scalar(tag, value, global_step=self._step)
        if self._tmp is not None and time.monotonic() - self._uploaded >= self.upload_interval_s:
            self._flush()

    def _flush(self) -> None:
        self._writer.flush()
        if self._tmp is None:
            return
        self._uploaded = time.monotonic()
        for local in glob.glob(os.path.join(self._tmp, EVENT_GLOB)):
            with open(local, "rb") as f:
                data = f.read()
            target = f"{self._remote_dir}/{os.path.basename(local)}"
            with self._filesystem.open_output_stream(target) as out:
                out.write(data)

    def _close(self) -> None:
        if self._writer is None:
            return
        try:
            self._flush()
        finally:
            self._writer.close()
            self._writer = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    def on_end(self, result: Any) -> None:
        self._close()

    def on_error(self, error: BaseException) -> None:
        self._close()


def bind_storage(callbacks: Iterable[Any], filesystem: Any) -> None:
    """Hand the run's filesystem to the callbacks that write into the run folder."""
    for callback in callbacks:
        if isinstance(callback, TBXLoggerCallback):
            callback._filesystem = filesystem
