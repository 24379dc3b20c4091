"""Where a Parquet dataset lives: a local path, a ``file://`` URL or any fsspec URL, read
in place (``storage_options`` go to ``fsspec.filesystem``); footers only, no rows."""

from __future__ import annotations

from typing import Any

__all__ = [
    "Options",
    "is_remote",
    "local_path",
    "open_dataset",
    "parquet_row_counts",
    "petastorm_url",
    "read_options",
]

Options = dict[str, Any] | None


def is_remote(path_or_url: str) -> bool:
    text = str(path_or_url)
    return "://" in text and not text.startswith("file://")


def local_path(path_or_url: str) -> str:
    text = str(path_or_url)
    return text[len("file://") :] if text.startswith("file://") else text


def petastorm_url(path_or_url: str) -> str:
    return str(path_or_url) if is_remote(path_or_url) else "file://" + local_path(path_or_url)


def read_options(url: str, storage_options: Options) -> dict[str, Any]:
    """``storage_options`` for reading Parquet in place: a filesystem that takes
    ``default_cache_type`` (s3fs, gcsfs, adlfs) gets ``"none"`` unless the caller chose
    one. Their default read-ahead cache turns every ranged read of a column chunk into
    one of ``default_block_size`` (50 MiB on s3fs), held per open file: more bytes
    fetched and more memory than the row group needs. pyarrow already coalesces a row
    group's column chunks into few exact ranged reads (``pre_buffer``)."""
    import inspect

    import fsspec

    options = dict(storage_options or {})
    if "default_cache_type" in options or "://" not in str(url):
        return options
    try:
        cls = fsspec.get_filesystem_class(str(url).split("://", 1)[0])
        takes = "default_cache_type" in inspect.signature(cls.__init__).parameters
    except (ImportError, ValueError, TypeError):
        return options  # url_to_fs says what is missing
    return {**options, "default_cache_type": "none"} if takes else options


def open_dataset(path_or_url: str, storage_options: Options) -> Any:
    """The ``pyarrow.dataset`` at a local path or fsspec URL (footers only: no rows read)."""
    import pyarrow.dataset as pads

    if not is_remote(path_or_url):
        return pads.dataset(local_path(path_or_url), format="parquet")
    import fsspec.core

    try:
        fs, path = fsspec.core.url_to_fs(
            str(path_or_url), **read_options(path_or_url, storage_options)
        )
    except (ImportError, ValueError) as exc:
        raise ValueError(
            f"cannot open the Parquet dataset {path_or_url!r} through fsspec: {exc}. Install "
            "the fsspec implementation of its scheme (s3fs for s3://, gcsfs for gs://, adlfs "
            "for abfs://) or pass a local path."
        ) from exc
    return pads.dataset(path, format="parquet", filesystem=fs)


def parquet_row_counts(path_or_url: str, storage_options: Options = None) -> list[int]:
    """Rows of every file of the Parquet dataset (from the footers), in file-name order."""
    dataset = open_dataset(path_or_url, storage_options)
    return [f.metadata.num_rows for f in sorted(dataset.get_fragments(), key=lambda f: f.path)]
