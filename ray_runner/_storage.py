"""Where a RingTrainer run lives: a ``pyarrow.fs`` filesystem and a path inside it.

``RunConfig(storage_path=...)`` is a plain path (the local filesystem) or a URI
(``s3://bucket/prefix``, ``gs://...``, ``hdfs://...``, ``file:///...``, or any scheme
an installed fsspec implementation knows). A URI is opened with
``pyarrow.fs.FileSystem.from_uri`` first and, for a scheme pyarrow lacks, through fsspec
(wrapped as a pyarrow filesystem), as Ray Train does. ``storage_filesystem=`` (a
``pyarrow.fs.FileSystem`` or an fsspec filesystem) overrides the URI's own; the path is
then taken inside it (``s3://bucket/run`` and ``bucket/run`` both name ``bucket/run``).

A :class:`Storage` pickles (the filesystem with its options), so the driver resolves
it once and every worker writes through the same one. :func:`check_writable` writes and
removes a probe file in the run folder before any worker starts.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import uuid
from dataclasses import dataclass
from typing import Any

from ringcore import RingError

from . import _constants as const

__all__ = ["Storage", "StorageError", "check_writable", "resolve"]

# Schemes whose filesystem lives inside one process: workers could never see its files.
_PROCESS_LOCAL = ("memory", "mock")


class StorageError(RingError, ValueError):
    """The run's storage cannot be opened or written; raised on the driver before workers start."""


@dataclass(frozen=True)
class Storage:
    """A filesystem and the storage root inside it; ``local`` when it is this machine's disk."""

    filesystem: Any  # pyarrow.fs.FileSystem
    root: str
    display: str  # what the user passed, for messages

    @property
    def local(self) -> bool:
        import pyarrow.fs as pafs

        return isinstance(self.filesystem, pafs.LocalFileSystem)

    def join(self, *parts: str) -> str:
        return (
            posixpath.join(self.root, *parts) if not self.local else os.path.join(self.root, *parts)
        )


def _scheme(raw: str) -> str | None:
    head, sep, _ = raw.partition("://")
    return head.lower() if sep and head and "/" not in head else None


def _as_arrow(filesystem: Any, what: str) -> Any:
    import pyarrow.fs as pafs

    if isinstance(filesystem, pafs.FileSystem):
        return filesystem
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec is a core dependency
        fsspec = None
    if fsspec is not None and isinstance(filesystem, fsspec.AbstractFileSystem):
        return pafs.PyFileSystem(pafs.FSSpecHandler(filesystem))
    raise StorageError(
        f"{what} must be a pyarrow.fs.FileSystem or an fsspec filesystem, got "
        f"{type(filesystem).__name__}; e.g. pyarrow.fs.S3FileSystem(endpoint_override=...)"
    )


def _from_uri(raw: str, scheme: str) -> tuple[Any, str]:
    import pyarrow as pa
    import pyarrow.fs as pafs

    if scheme in _PROCESS_LOCAL:
        raise StorageError(
            f"RunConfig(storage_path={raw!r}): a {scheme}:// filesystem lives inside one process, "
            "and RingTrainer's workers are other processes that could never see its files; "
            "use a local folder, a shared mount or an object store URI (s3://bucket/prefix)"
        )
    arrow_error: Exception | None = None
    try:
        return pafs.FileSystem.from_uri(raw)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, ValueError) as exc:
        arrow_error = exc
    except OSError as exc:  # a known scheme that failed to open (credentials, region, bucket)
        raise StorageError(
            f"RunConfig(storage_path={raw!r}): pyarrow could not open its filesystem ({exc}); "
            "check the URI, the credentials in the environment, or pass "
            "RunConfig(storage_filesystem=...) configured for it"
        ) from exc
    try:
        import fsspec

        fs, path = fsspec.core.url_to_fs(raw)
    except (ImportError, ValueError) as exc:
        raise StorageError(
            f"RunConfig(storage_path={raw!r}): no filesystem knows the scheme {scheme!r} "
            f"(pyarrow: {arrow_error}; fsspec: {exc}); install the fsspec package for it "
            "(s3fs for s3://, gcsfs for gs://, adlfs for abfs://) or pass "
            "RunConfig(storage_filesystem=...)"
        ) from exc
    return _as_arrow(fs, "the fsspec filesystem"), path


def resolve(storage_path: str | os.PathLike | None, storage_filesystem: Any = None) -> Storage:
    """The storage of ``RunConfig(storage_path, storage_filesystem)`` (default: ``$RING_STORAGE_PATH``)."""
    import pyarrow.fs as pafs

    raw = (
        os.fspath(storage_path)
        if storage_path is not None
        else os.environ.get(const.STORAGE_PATH_ENV_VAR) or const.DEFAULT_STORAGE_PATH
    )
    scheme = _scheme(raw)
    if storage_filesystem is not None:
        fs = _as_arrow(storage_filesystem, "RunConfig.storage_filesystem")
        path = raw.split("://", 1)[1] if scheme else raw
        if isinstance(fs, pafs.LocalFileSystem):
            path = os.path.abspath(os.path.expanduser(path))
        return Storage(fs, path.rstrip("/") or "/", raw)
    if scheme is None:
        return Storage(pafs.LocalFileSystem(), const.storage_path(raw), raw)
    fs, path = _from_uri(raw, scheme)
    if isinstance(fs, pafs.LocalFileSystem):
        path = os.path.abspath(path)
    return Storage(fs, path.rstrip("/") or "/", raw)


def check_writable(storage: Storage, run_dir: str) -> None:
    """Create ``run_dir`` and write, then remove, a probe file there; a clear error otherwise."""
    import pyarrow.fs as pafs

    if not storage.local:
        bucket = storage.root.split("/", 1)[0]
        try:
            info = storage.filesystem.get_file_info(bucket)
        except OSError as exc:
            raise StorageError(
                f"RunConfig(storage_path={storage.display!r}): cannot reach {bucket!r} ({exc}); "
                "check the endpoint and credentials (AWS_* variables for s3://) or pass "
                "RunConfig(storage_filesystem=...)"
            ) from exc
        if info.type == pafs.FileType.NotFound:
            raise StorageError(
                f"RunConfig(storage_path={storage.display!r}): the bucket {bucket!r} does not "
                "exist; create it first or point storage_path at an existing one"
            )
    probe = f"{run_dir}/.probe_{uuid.uuid4().hex}"
    try:
        storage.filesystem.create_dir(run_dir, recursive=True)
        with storage.filesystem.open_output_stream(probe) as out:
            out.write(b"ringtrain")
    except OSError as exc:
        raise StorageError(
            f"RunConfig(storage_path={storage.display!r}): cannot write the run folder "
            f"{run_dir!r} ({exc}); give this process and every worker write access there, "
            "or pick another storage_path"
        ) from exc
    with contextlib.suppress(OSError):
        storage.filesystem.delete_file(probe)
