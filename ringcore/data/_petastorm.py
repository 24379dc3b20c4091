"""The petastorm reader: ``make_batch_reader`` sharded by row group (``cur_shard=rank,
shard_count=size``); petastorm and fsspec are imported only inside these functions."""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ._columns import Batch, stack_objects
from ._sources import Options, is_remote, read_options

__all__ = ["open_petastorm", "petastorm_chunks"]


def _quiet_petastorm() -> None:
    """Petastorm 0.12 calls pyarrow APIs deprecated since pyarrow 5, with a FutureWarning
    each time, from its reader threads too; nobody downstream can act on them. Ignore
    exactly those: FutureWarnings attributed to petastorm's own modules."""
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"petastorm(\.|$)")


def _petastorm_filesystem(url: str, storage_options: Options) -> Any:
    """For a remote URL, the fsspec filesystem wrapped as the legacy
    ``pyarrow.filesystem`` kind that petastorm 0.12's ``ParquetDataset`` calls need
    (pyarrow 14's new dataset API refuses petastorm's arguments); None for a local path."""
    if not is_remote(url):
        return None
    import fsspec.core

    fs = fsspec.core.url_to_fs(url, **read_options(url, storage_options))[0]
    with warnings.catch_warnings():  # DaskFileSystem is deprecated: petastorm needs it
        warnings.simplefilter("ignore", FutureWarning)
        return _legacy_class()(fs)


_LEGACY: list[type] = []


def _legacy_class() -> type:
    """The legacy filesystem class, made on first use (its base is deprecated and warns
    on import); it is this module's ``_LegacyFilesystem``, so petastorm's process pool
    can pickle an instance by reference."""
    if _LEGACY:
        return _LEGACY[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        from pyarrow.filesystem import DaskFileSystem

    class _LegacyFilesystem(DaskFileSystem):
        def isdir(self, path: str) -> bool:
            return bool(self.fs.isdir(path))

        def isfile(self, path: str) -> bool:
            return bool(self.fs.isfile(path))

        @property
        def pathsep(self) -> str:
            return "/"

        def walk(self, path: str) -> Iterator[tuple[str, list[str], list[str]]]:
            for root, dirs, files in self.fs.walk(path):
                yield root, sorted(dirs), sorted(files)

    _LegacyFilesystem.__module__ = __name__
    _LegacyFilesystem.__qualname__ = "_LegacyFilesystem"
    _LEGACY.append(_LegacyFilesystem)
    return _LegacyFilesystem


def __getattr__(name: str) -> Any:  # pickle finds the lazily made class by its name
    if name == "_LegacyFilesystem":
        return _legacy_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def open_petastorm(
    url: str,
    rank: int,
    size: int,
    columns: Sequence[str],
    num_epochs: int | None,
    shuffle: bool,
    seed: int,
    workers_count: int,
    storage_options: Options = None,
    pool_type: str = "thread",
) -> Any:
    from petastorm import make_batch_reader
    from petastorm.errors import NoDataAvailableError

    _quiet_petastorm()
    try:
        return make_batch_reader(
            url,
            schema_fields=[re.escape(c) + "$" for c in columns],
            cur_shard=rank,
            shard_count=size,
            num_epochs=num_epochs,
            shuffle_row_groups=shuffle,
            seed=seed,
            workers_count=workers_count,
            reader_pool_type=pool_type,
            # a few row groups decoded ahead, not petastorm's 50: memory stays flat
            results_queue_size=max(2, 2 * workers_count),
            filesystem=_petastorm_filesystem(url, storage_options),
        )
    except NoDataAvailableError as exc:
        raise ValueError(
            f"the Parquet dataset {url} has fewer row groups than the {size} ranks reading it, so "
            f"petastorm leaves some rank without data ({exc}). Write at least {size} row groups, "
            "or use reader='arrow', which shards by rows."
        ) from exc


def petastorm_chunks(reader: Any, columns: Sequence[str]) -> Iterator[Batch]:
    for batch in reader:
        found = batch._asdict()
        yield {c: stack_objects(c, np.asarray(found[c])) for c in columns}
