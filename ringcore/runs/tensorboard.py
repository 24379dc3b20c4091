"""TensorBoard scalars of a run: written through tensorboardX, read back without a server.

:class:`EventWriter` is one event file: written in place in a local folder, or, for a
run kept in remote storage, in a local temporary folder whose event files each
:meth:`~EventWriter.flush` hands to an ``upload(name, data)`` of the caller's (the
store's ``write_bytes``, a pyarrow filesystem's output stream); the temporary folder is
removed however the run ends. :class:`ScalarWriter` is rank 0's writer of a
:class:`~ringcore.runs.stores.RunStore` run, under ``<store>/runs/<run_id>/logs`` (where
Horovod's estimators put their logs): ``step/loss`` (rank 0's batch loss, global step
from 1) and, per epoch, ``epoch/<name>`` for every number of the history entry (step =
the epoch, from 1). ray_runner's ``TBXLoggerCallback`` writes its run's reports through
an :class:`EventWriter` too. Writing needs ``tensorboardX`` (the ``tensorboard`` extra).

:func:`read_scalars` reads such files back (a small reader of the TFRecord framing and
the ``Event`` protobuf that tensorboardX ships), e.g. to plot loss curves in a notebook.
"""

from __future__ import annotations

import glob
import os
import posixpath
import shutil
import struct
import tempfile
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from .tracking import numeric

__all__ = ["EVENT_GLOB", "EventWriter", "ScalarWriter", "read_scalars"]

EVENT_GLOB = "events.out.tfevents.*"


class EventWriter:
    """One tensorboardX event file in ``folder``, or, given ``upload``, in a temporary
    folder whose files :meth:`flush` uploads as ``upload(file name, data)``."""

    def __init__(
        self, folder: str | None = None, upload: Callable[[str, bytes], None] | None = None
    ):
        from tensorboardX import SummaryWriter

        self._upload = upload
        self._tmp: str | None = None
        if upload is not None:
            folder = self._tmp = tempfile.mkdtemp(prefix="ringtrain-tb-")
            # removed however the run ends (close() is not reached when training raises)
            self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)
        elif folder is None:
            raise ValueError("EventWriter needs a local folder, or an upload for a remote one")
        os.makedirs(folder, exist_ok=True)
        self._folder = folder
        self._writer: Any = SummaryWriter(logdir=folder, flush_secs=30)

    @property
    def folder(self) -> str:
        """The local folder the event file is written to."""
        return self._folder

    @property
    def uploads(self) -> bool:
        """Whether :meth:`flush` uploads (the folder is a temporary one)."""
        return self._upload is not None

    def add(self, tag: str, value: float, step: int) -> None:
        self._writer.add_scalar(tag, float(value), global_step=int(step))

    def flush(self) -> None:
        """Write what is buffered, and upload the event files when the folder is a
        temporary one. (tensorboardX's flush does not wait for the events its writer
        thread still holds: an upload may lag a few events; :meth:`close` does not.)"""
        self._writer.flush()
        self._send()

    def _send(self) -> None:
        if self._upload is None:
            return
        for path in glob.glob(os.path.join(self.folder, EVENT_GLOB)):
            with open(path, "rb") as f:
                data = f.read()
            self._upload(os.path.basename(path), data)

    def close(self, upload: bool = True) -> None:
        """Close the file (every event written), then (``upload``) upload it, and remove
        the temporary folder."""
        try:
            self._writer.close()
            if upload:
                self._send()
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


class ScalarWriter:
    """Rank 0's event file of a run in a store (see the module docstring); every method
    is a no-op without tensorboardX."""

    def __init__(self, store: Any, run_id: str):
        self._writer: EventWriter | None = None
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            return
        logs = store.get_logs_path(run_id)
        if store.is_local():
            self._writer = EventWriter(logs)
        else:
            remote = posixpath.join(logs, "")
            self._writer = EventWriter(
                upload=lambda name, data: store.write_bytes(remote + name, data)
            )

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add(self, tag: str, value: float, step: int) -> None:
        if self._writer is not None:
            self._writer.add(tag, value, step)

    def add_epoch(self, entry: dict[str, Any]) -> None:
        """Every number of a history entry as ``epoch/<name>`` at step ``entry["epoch"]``."""
        epoch = int(entry["epoch"])
        numbers = numeric(entry, skip=("epoch", "seconds"), nested=False, finite=False)
        for name, value in numbers.items():
            self.add(f"epoch/{name}", value, epoch)
        self.flush()

    def flush(self) -> None:
        """Write what is buffered (and copy it into a remote store)."""
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close()

    def abort(self) -> None:
        """Drop the writer without uploading (the run failed: the store may be the cause)."""
        if self._writer is not None:
            writer, self._writer = self._writer, None
            writer.close(upload=False)


def _records(data: bytes) -> Iterator[bytes]:
    """The payloads of TFRecord framing: length (u64), its crc, payload, its crc."""
    offset = 0
    while offset + 12 <= len(data):
        (length,) = struct.unpack_from("<Q", data, offset)
        start = offset + 12
        if start + length + 4 > len(data):
            return  # a record still being written
        yield data[start : start + length]
        offset = start + length + 4


def _scalars_of(data: bytes, out: dict[str, list[tuple[int, float]]]) -> None:
    from tensorboardX.proto import event_pb2

    for record in _records(data):
        event = event_pb2.Event()
        event.ParseFromString(record)
        if not event.HasField("summary"):
            continue
        for value in event.summary.value:
            if value.HasField("simple_value"):
                out.setdefault(value.tag, []).append((int(event.step), float(value.simple_value)))


def read_scalars(folder: str) -> dict[str, list[tuple[int, float]]]:
    """``{tag: [(step, value), ...]}`` from every event file in the local ``folder``,
    in file order then write order. Raises FileNotFoundError naming the folder when it
    holds no event file."""
    paths = sorted(glob.glob(os.path.join(folder, EVENT_GLOB)))
    if not paths:
        raise FileNotFoundError(
            f"no TensorBoard event file ({EVENT_GLOB}) in {folder!r}; rank 0 writes them there "
            "during a fit when tensorboardX is installed (pip install 'ringtrain[tensorboard]')"
        )
    out: dict[str, list[tuple[int, float]]] = {}
    for path in paths:
        with open(path, "rb") as f:
            _scalars_of(f.read(), out)
    return out
