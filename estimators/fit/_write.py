"""Step 3 of a fit: the DataFrame becomes balanced Parquet in the Store.

Petastorm shards by row group, so uneven files give ranks uneven data (seen:
6,264 vs 3,736 rows of 10,000 on two ranks). We therefore write ``num_proc x
partitions_per_process`` files with ``repartition`` (round-robin: equal to within a few
rows), each of row groups of about ``ROW_GROUP_BYTES`` (one for small data): each rank
gets every num_proc-th row group, the same share. And we fix the steps per
epoch from the row count so that every rank runs the same number of steps. Spark
writes the files, or the executors' Python workers through fsspec where Spark's
Hadoop cannot write the store (the choice was made in step 1: ``data/_parquet_writer``).

Data an earlier fit of the same DataFrame prepared (``_cache``) is used as it is. Each
preparation claims its own data index in the store (:meth:`Store.next_data_index`), so
concurrent fits on one store never share one; a failed preparation removes what it
wrote there, and nothing of another fit's. Parquet already in the store
(``fit_on_parquet``) is checked and described the same way (:func:`describe_stored`).
"""

from __future__ import annotations

import logging
from typing import Any

from pyspark.sql import DataFrame

from ringcore.data import resolve_reader, to_numpy_columns

from ..data._columns import read_columns, selected_columns, validation_marker
from ..data._parquet_writer import write_parquet
from ..store._store import Store
from ._cache import remember
from ._config import CheckedData, FitConfig, PreparedData, steps_per_epoch

log = logging.getLogger("ringtrain.estimators")

__all__ = ["describe_stored", "write_data"]


def _null_counts(dataset: Any) -> dict[str, int]:
    """Nulls per top-level column, from the Parquet footers' statistics (no data read)."""
    counts: dict[str, int] = {}
    for fragment in dataset.get_fragments():
        meta = fragment.metadata
        for g in range(meta.num_row_groups):
            group = meta.row_group(g)
            for j in range(group.num_columns):
                column = group.column(j)
                stats = column.statistics
                if stats is not None and stats.has_null_count and stats.null_count:
                    name = column.path_in_schema.split(".")[0]
                    counts[name] = counts.get(name, 0) + stats.null_count
    return counts


def _check_nulls(dataset: Any, what: str) -> None:
    for name, count in sorted(_null_counts(dataset).items()):
        raise ValueError(
            f"column {name!r} of the {what} data has {count} null value(s) (or null array "
            "elements); models need a value in every row. Drop those rows "
            f"(df.na.drop(subset=[{name!r}])) or fill them (df.na.fill(...)) before fit."
        )


def _check_files(store: Store, path: str, what: str, num_proc: int, reader: str) -> int:
    dataset = store.parquet_dataset(path)
    fragments = list(dataset.get_fragments())
    rows = sum(f.metadata.num_rows for f in fragments)
    groups = [f.metadata.num_row_groups for f in fragments]
    _check_nulls(dataset, what)
    if rows < num_proc:
        raise ValueError(
            f"the {what} data has {rows} rows, fewer than num_proc={num_proc}: some process would "
            "have nothing to read. Give it more rows (a larger DataFrame or validation fraction) "
            "or lower num_proc."
        )
    if resolve_reader(reader) == "petastorm" and sum(groups) < num_proc:
        raise ValueError(
            f"the {what} data has {rows} rows in {sum(groups)} Parquet row groups, fewer than "
            f"num_proc={num_proc}, so petastorm would leave a process without data. Give it more "
            "rows (a larger DataFrame or validation fraction), lower num_proc, or set reader='arrow'."
        )
    shares = _petastorm_shares(fragments, num_proc)
    if resolve_reader(reader) == "petastorm" and min(shares) * 5 < max(shares) * 4:
        log.warning(
            "the %s data is in %d files with %s row groups; petastorm shards by row group, "
            "so processes read unequal amounts of data (%s rows)",
            what,
            len(groups),
            groups,
            shares,
        )
    return rows


def _petastorm_shares(fragments: list[Any], num_proc: int) -> list[int]:
    """Rows per process under petastorm's sharding: row group ``i`` (files in path order)
    to process ``i % num_proc``. Large data has several row groups per file (of about
    ``ROW_GROUP_BYTES``), which still splits evenly."""
    sizes = [
        f.metadata.row_group(g).num_rows
        for f in sorted(fragments, key=lambda f: f.path)
        for g in range(f.metadata.num_row_groups)
    ]
    return [sum(sizes[r::num_proc]) for r in range(num_proc)]


def _feature_shapes(store: Store, path: str, feature_cols: list[str]) -> list[list[int]]:
    first = to_numpy_columns(
        store.parquet_dataset(path).head(1, columns=feature_cols), feature_cols
    )
    # a text column (strings) has no shape of its own: [] (a number: [1])
    return [
        [] if first[c].dtype == object else list(first[c].shape[1:]) or [1] for c in feature_cols
    ]


def _check_parquet_columns(cfg: FitConfig, paths: list[str]) -> None:
    """Data already in the store must exist and hold every column the params name."""
    wanted = read_columns(cfg.feature_cols, cfg.label_cols, cfg.sample_weight_col)
    for path in paths:
        if not cfg.store.exists(path):
            raise ValueError(
                f"no Parquet data at {path}; pass paths inside the store {cfg.store.prefix_path}, "
                "e.g. store.get_train_data_path(0) of an earlier fit."
            )
        present = cfg.store.parquet_dataset(path).schema.names
        missing = [c for c in wanted if c not in present]
        if missing:
            raise ValueError(
                f"the Parquet data at {path} has no column(s) {', '.join(missing)}; its columns "
                f"are: {', '.join(present)}. Set feature_cols / label_cols to columns it has."
            )


def _describe(cfg: FitConfig, train_path: str, val_path: str | None) -> PreparedData:
    """Check Parquet already in the store (row counts, row groups, nulls) and describe it."""
    train_rows = _check_files(cfg.store, train_path, "training", cfg.num_proc, cfg.reader)
    val_rows = 0
    if val_path is not None:
        val_rows = _check_files(cfg.store, val_path, "validation", cfg.num_proc, cfg.reader)
    return PreparedData(
        train_path=train_path,
        val_path=val_path,
        train_rows=train_rows,
        val_rows=val_rows,
        steps_per_epoch=steps_per_epoch(cfg, train_rows),
        feature_shapes=_feature_shapes(cfg.store, train_path, cfg.feature_cols),
    )


def describe_stored(cfg: FitConfig, train_path: str, val_path: str | None) -> PreparedData:
    """Parquet already in the store (``fit_on_parquet``): present, holding every column
    the params name, checked (row counts, row groups, nulls) and described."""
    _check_parquet_columns(cfg, [train_path] + ([val_path] if val_path is not None else []))
    return _describe(cfg, train_path, val_path)


def _split(df: DataFrame, cfg: FitConfig) -> tuple[DataFrame, DataFrame | None]:
    """The selected columns of the training rows and of the validation rows (or None)."""
    schema, weight = df.schema, cfg.sample_weight_col
    typed = cfg.framework.typed_features
    chosen = selected_columns(schema, cfg.feature_cols, cfg.label_cols, weight, typed)
    columns = [e for _, _, e in chosen]
    if isinstance(cfg.validation, str):
        marked = validation_marker(cfg.validation)
        return df.filter(~marked).select(*columns), df.filter(marked).select(*columns)
    selected = df.select(*columns)
    if cfg.validation > 0:
        train_df, val_df = selected.randomSplit(
            [1.0 - cfg.validation, cfg.validation], seed=cfg.seed
        )
        return train_df, val_df
    return selected, None


def _row_bytes(batch: dict[str, Any] | None) -> float | None:
    """A row's size in memory, from the first rows ``check_data`` returned (None: unknown)."""
    if not batch:
        return None
    rows = max(len(next(iter(batch.values()))), 1)
    return sum(getattr(v, "nbytes", 0) for v in batch.values()) / rows


def write_data(df: DataFrame, cfg: FitConfig, checked: CheckedData) -> PreparedData:
    """Select and flatten the columns, split off validation, write Parquet under the
    Store (or use what an earlier fit of the same data wrote: ``checked.cached``)."""
    if checked.cached is not None:
        return checked.cached
    row_bytes = _row_bytes(checked.batch)
    train_df, val_df = _split(df, cfg)
    idx = cfg.store.next_data_index()
    train_path = cfg.store.get_train_data_path(idx)
    val_path = cfg.store.get_val_data_path(idx) if val_df is not None else None
    files = cfg.num_proc * cfg.partitions_per_process
    writer = cfg.parquet_writer
    try:
        write_parquet(train_df, cfg.store, train_path, files, writer, row_bytes)
        if val_df is not None and val_path is not None:
            write_parquet(val_df, cfg.store, val_path, files, writer, row_bytes)
        data = _describe(cfg, train_path, val_path)
    except BaseException:
        cfg.store.release_data_index(idx)  # this fit's claimed index only, never another's
        raise
    log.info("wrote %d training and %d validation rows to %s", data.train_rows, data.val_rows, idx)
    remember(df, cfg, data)
    return data
