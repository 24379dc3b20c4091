"""What ``fit`` checks before it trains, so that bad input fails early and leaves nothing behind.

Before any Spark job (from the params alone, :func:`check_config`): every object
shipped to the workers pickles, the store takes writes, and a ``run_id`` that already
has a checkpoint was trained on a model with these parameters. On Spark Connect
(:func:`check_connect_store`) also that the server sees the store this client writes to.

One Spark job, before the data is written (:func:`check_data`): one aggregation over
the selected columns counts the rows, the nulls, the NaNs and the array lengths, and
picks two rows: the first batch that the caller runs through the model and the loss
(the framework's ``check_first_batch``). Nulls and NaNs can only be found by reading
the data, hence this one job; it writes nothing.
"""

from __future__ import annotations

import contextlib
import io
import posixpath
import uuid
from typing import Any

import cloudpickle
import numpy as np
import torch
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, FractionalType

from ._columns import selected_columns, validation_marker
from ._frameworks import get_framework

__all__ = ["check_config", "check_connect_store", "check_data"]


# --- from the params alone ---------------------------------------------------------------------


def _check_pickles(name: str, value: Any, setter: str) -> None:
    try:
        cloudpickle.dumps(value)
    except Exception as exc:
        raise ValueError(
            f"{name} ({type(value).__name__}) cannot be pickled, so it cannot be sent to the "
            f"workers: {type(exc).__name__}: {exc}. Keep unpicklable state (locks, threads, open "
            "files, sockets, a SparkSession) out of it, e.g. create it lazily on first use or drop "
            f"it in __getstate__, then pass it again with {setter}(...)."
        ) from exc


def _check_store_writable(store: Any) -> None:
    probe = posixpath.join(store.prefix_path, f".ringtrain-write-probe-{uuid.uuid4().hex[:8]}")
    try:
        store.write_bytes(probe, b"")
    except OSError as exc:
        raise ValueError(
            f"the store {store.prefix_path} does not take writes ({type(exc).__name__}: "
            f"{exc.strerror or exc}); fit writes its data and checkpoints there. Pass a store "
            "you can write to with setStore(...), or fix its permissions or free space."
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            store.rm(probe)


def _state_difference(saved: dict[str, Any], current: dict[str, Any]) -> str | None:
    missing = sorted(set(current) - set(saved))
    extra = sorted(set(saved) - set(current))
    if missing or extra:
        parts = []
        if missing:
            parts.append(f"this model has {', '.join(missing[:3])} which the checkpoint lacks")
        if extra:
            parts.append(f"the checkpoint has {', '.join(extra[:3])} which this model lacks")
        return "; ".join(parts)
    for key, value in current.items():
        old = saved[key]
        if hasattr(value, "shape") and hasattr(old, "shape") and value.shape != old.shape:
            return (
                f"parameter {key!r} has shape {list(old.shape)} in the checkpoint but "
                f"{list(value.shape)} in this model"
            )
    return None


def _check_run_id(store: Any, run_id: str, model: Any) -> None:
    """A ``run_id`` with a checkpoint resumes it: the model must have the same parameters."""
    path = store.find_checkpoint(run_id)
    if path is None or not callable(getattr(model, "state_dict", None)):
        return
    try:
        if store.is_local():
            checkpoint = torch.load(path, weights_only=True, mmap=True, map_location="cpu")
        else:
            checkpoint = torch.load(
                io.BytesIO(store.read_bytes(path)), weights_only=True, map_location="cpu"
            )
    except Exception as exc:
        raise ValueError(
            f"run_id {run_id!r} has a checkpoint at {path} that cannot be read "
            f"({type(exc).__name__}: {exc}); a fit with this run_id would resume from it. Pick "
            f"a new run_id with setRunId(...), or delete {store.get_run_path(run_id)} to start over."
        ) from exc
    saved = checkpoint.get("model") if isinstance(checkpoint, dict) else None
    if not isinstance(saved, dict):
        return
    difference = _state_difference(saved, model.state_dict())
    if difference:
        raise ValueError(
            f"run_id {run_id!r} already has a checkpoint at {path} from a different model "
            f"({difference}); a fit with an existing run_id resumes that run. Pick a new run_id "
            f"with setRunId(...), or delete {store.get_run_path(run_id)} to start the run over."
        )


def check_config(cfg: Any) -> None:
    """The checks of a resolved ``FitConfig`` that need no data and start no job."""
    if get_framework(cfg.framework).pickles_model:
        _check_pickles("model", cfg.model, "setModel")
    for name, setter in (
        ("loss", "setLoss"),
        ("metrics", "setMetrics"),
        ("transformation_fn", "setTransformationFn"),
        ("callbacks", "setCallbacks"),
    ):
        value = getattr(cfg, name, None)
        if value is not None:
            _check_pickles(name, value, setter)
    _check_store_writable(cfg.store)
    _check_run_id(cfg.store, cfg.run_id, cfg.model)


def check_connect_store(spark: Any, store: Any) -> None:
    """On a Spark Connect session the server's cluster writes the data into the store and
    this client reads it back (row counts, checkpoints, history), so both must reach the
    same store: a store on this client's disk (the default one, a temporary directory,
    say) is lost on a remote server. This client writes a probe file there and the server
    lists it (``inputFiles``: an analysis, no job); a server that cannot is refused."""
    name = f"ringtrain-connect-probe-{uuid.uuid4().hex[:8]}"  # no dot: Spark skips hidden files
    probe = posixpath.join(store.prefix_path, name)
    store.write_bytes(probe, b"")
    try:
        spark.read.text(store.url(probe)).inputFiles()
    except Exception as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ValueError(
            f"the Spark Connect server cannot see the store {store.prefix_path}: this client "
            f"wrote {probe} there, and the server, reading {store.url(probe)}, got: {first}. "
            "On Spark Connect the server's cluster writes the training data into the store and "
            "this client reads it back, so both must reach it. Pass a store they share with "
            "setStore(...): a filesystem mounted at the same path on this client and the "
            "cluster, or an object store URL (s3://, gs://, abfs://, hdfs://, dbfs:/)."
        ) from exc
    finally:
        with contextlib.suppress(OSError):
            store.rm(probe)


# --- one aggregation over the data ----------------------------------------------------------


def _count(condition: Column) -> Column:
    return F.sum(F.when(condition, 1).otherwise(0))


_VAL = "__ringtrain_validation"


def _aggregations(frame: DataFrame, fields: list[Any], validation: bool) -> list[Column]:
    aggs = [F.count(F.lit(1)).alias("rows")]
    if validation:
        aggs.append(_count(F.col(_VAL)).alias("val_rows"))
    for i, field in enumerate(fields):
        col = F.col(f"`{field.name}`")
        if isinstance(field.dataType, ArrayType):
            aggs.append(_count(col.isNull() | F.exists(col, lambda x: x.isNull())).alias(f"n{i}"))
            aggs.append(_count(F.exists(col, lambda x: F.isnan(x))).alias(f"nan{i}"))
            aggs.append(F.min(F.size(col)).alias(f"min{i}"))
            aggs.append(F.max(F.size(col)).alias(f"max{i}"))
        else:
            aggs.append(_count(col.isNull()).alias(f"n{i}"))
            if isinstance(field.dataType, FractionalType):
                aggs.append(_count(F.isnan(col)).alias(f"nan{i}"))
    row = F.struct(*[F.col(f"`{f.name}`") for f in fields])
    return [*aggs, F.first(row).alias("first"), F.last(row).alias("last")]


def _raise_for_values(stats: dict[str, Any], selected: list[tuple[str, str, Column]]) -> None:
    for i, (role, name, _) in enumerate(selected):
        nulls = stats[f"n{i}"] or 0
        if nulls:
            array = f"min{i}" in stats
            drop = (
                f"df.filter(F.col({name!r}).isNotNull() & ~F.exists({name!r}, lambda v: v.isNull()))"
                if array
                else f"df.na.drop(subset=[{name!r}])"
            )
            raise ValueError(
                f"{role} column {name!r} of the training data has {nulls} null value(s) (rows "
                "with a null, or a null array element); models need a value in every row. Drop "
                f"those rows ({drop}) or fill them (df.na.fill(...)) before fit."
            )
        nans = stats.get(f"nan{i}") or 0
        if nans:
            raise ValueError(
                f"{role} column {name!r} has {nans} row(s) holding NaN; the loss would turn NaN. "
                f"Drop those rows (df.filter(~F.isnan({name!r})) for a scalar column) or replace "
                f"the NaNs (df.na.fill(0.0, subset=[{name!r}])) before fit."
            )
        low, high = stats.get(f"min{i}"), stats.get(f"max{i}")
        if low is not None and low != high:
            raise ValueError(
                f"{role} column {name!r} holds arrays of different lengths ({low} to {high}); a "
                "batch needs one length. Pad or cut them to one length (e.g. F.slice) before fit."
            )


def _raise_for_rows(stats: dict[str, Any], cfg: Any) -> None:
    rows = stats["rows"]
    needed = cfg.num_proc * cfg.batch_size
    if rows == 0:
        raise ValueError(
            f"the DataFrame is empty (0 rows); fit needs at least num_proc * batch_size = "
            f"{cfg.num_proc} * {cfg.batch_size} = {needed} training rows. Check the filter or "
            "join that produced it."
        )
    if isinstance(cfg.validation, str):
        train_rows, how = rows - (stats["val_rows"] or 0), ""
    else:  # a random split: the expected count (the workers' reader covers a few short)
        train_rows = int(rows * (1.0 - cfg.validation))
        how = "about " if cfg.validation else ""
    if train_rows < needed:
        raise ValueError(
            f"the training data has {how}{train_rows} rows, fewer than num_proc={cfg.num_proc} * "
            f"batch_size={cfg.batch_size} = {needed}, so a process would not get one full batch. "
            "Lower batch_size (setBatchSize) or num_proc (setNumProc), or give it more rows."
        )


def _batch_of(rows: list[Any], fields: list[Any]) -> dict[str, np.ndarray]:
    """``{column: ndarray}`` as the workers' readers give it (float32, int64, 2-D arrays)."""
    batch = {}
    for field in fields:
        values = [r[field.name] for r in rows]
        integral = field.dataType.typeName() in ("long", "integer", "short", "byte")
        batch[field.name] = np.asarray(values, dtype=np.int64 if integral else np.float32)
    return batch


def check_data(df: DataFrame, cfg: Any) -> dict[str, np.ndarray] | None:
    """One Spark job over the columns fit reads: rows, nulls, NaNs, array lengths.
    Raises ValueError naming the column; returns two rows as a first batch."""
    selected = selected_columns(df.schema, cfg.feature_cols, cfg.label_cols, cfg.sample_weight_col)
    exprs = [expr for _, _, expr in selected]
    validation = isinstance(cfg.validation, str)
    if validation:
        exprs.append(validation_marker(cfg.validation).alias(_VAL))
    frame = df.select(*exprs)
    fields = frame.schema.fields[: len(selected)]
    stats = frame.agg(*_aggregations(frame, fields, validation)).first()
    if stats is None:
        return None
    values = stats.asDict()
    _raise_for_rows(values, cfg)
    _raise_for_values(values, selected)
    return _batch_of([values["first"], values["last"]], fields)
