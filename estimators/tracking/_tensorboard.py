"""TensorBoard scalars of a fit: written by rank 0, read back without a TensorBoard server.

Rank 0 writes event files under ``<store>/runs/<run_id>/logs`` (where Horovod's
estimators put their logs): ``step/loss`` (the batch loss of rank 0, global step from
1), and per epoch ``epoch/<name>`` for every number of the history entry
(``train_loss``, ``val_loss``, metrics, ``lr``; step = the epoch, from 1). A local
store gets the files in place; for a remote one they are written to a local folder
and copied into the store at every epoch's end (through the Store API). Writing needs
``tensorboardX`` (the ``tensorboard`` extra); without it nothing is written.

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
from typing import Any

__all__ = ["EVENT_GLOB", "ScalarWriter", "read_scalars", "read_tensorboard_scalars"]

EVENT_GLOB = "events.out.tfevents.*"


class ScalarWriter:
    """Rank 0's event file of one fit; every method is a no-op without tensorboardX."""

    def __init__(self, store: Any, run_id: str):
        self._store = store
        self._remote = posixpath.join(store.get_logs_path(run_id), "")
        self._writer: Any = None
        self._tmp: str | None = None
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            return
        if store.is_local():
            folder = store.get_logs_path(run_id)
            os.makedirs(folder, exist_ok=True)
        else:
            folder = self._tmp = tempfile.mkdtemp(prefix="ringtrain-tb-")
            # removed however the fit ends (close() is not reached when training raises)
            self._cleanup = weakref.finalize(self, shutil.rmtree, folder, True)
        self._writer = SummaryWriter(logdir=folder, flush_secs=30)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add(self, tag: str, value: float, step: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar(tag, float(value), global_step=int(step))

    def add_epoch(self, entry: dict[str, Any]) -> None:
        """Every number of a history entry as ``epoch/<name>`` at step ``entry["epoch"]``."""
        epoch = int(entry["epoch"])
        for name, value in entry.items():
            if name in ("epoch", "seconds") or isinstance(value, bool):
                continue
            if isinstance(value, (int, float)):
                self.add(f"epoch/{name}", value, epoch)
        self.flush()

    def flush(self) -> None:
        """Write what is buffered (and copy it into a remote store)."""
        if self._writer is None:
            return
        self._writer.flush()
        if self._tmp is not None:
            for path in glob.glob(os.path.join(self._tmp, EVENT_GLOB)):
                with open(path, "rb") as f:
                    data = f.read()
                self._store.write_bytes(self._remote + os.path.basename(path), data)

    def close(self) -> None:
        if self._writer is None:
            return
        try:
            self.flush()
        finally:
            self._writer.close()
            self._writer = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)

    def abort(self) -> None:
        """Drop the writer without uploading (the fit failed: the store may be the cause)."""
        if self._writer is None:
            return
        try:
            self._writer.close()
        finally:
            self._writer = None
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)


def _records(data: bytes):
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


def read_tensorboard_scalars(store: Any, run_id: str) -> dict[str, list[tuple[int, float]]]:
    """:func:`read_scalars` of a run's logs folder in ``store`` (local or remote)."""
    folder = store.get_logs_path(run_id)
    if store.is_local():
        return read_scalars(folder)
    local = store.localize(folder)
    try:
        return read_scalars(local)
    finally:
        shutil.rmtree(os.path.dirname(local), ignore_errors=True)
