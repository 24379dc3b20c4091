"""What ``fit`` checks before it trains, so that bad input fails early and leaves nothing behind.

Before any Spark job (from the params alone, :func:`check_config`): every object
shipped to the workers pickles, the store takes writes, and a ``run_id`` that already
has a checkpoint was trained on a model with these parameters. :func:`check_slots`:
the cluster has ``num_proc`` task slots (before the data is written).

One Spark job, before the data is written (:func:`check_data`): one aggregation over
the selected columns counts the rows, the nulls, the NaNs and the array lengths, and
picks two rows. Those two rows are a first batch that the driver runs through the
model and the loss (:func:`check_first_batch`), so a loss that does not fit the
label's shape fails here, naming both shapes, instead of inside torch on a worker.
Nulls and NaNs can only be found by reading the data, hence this one job; it writes
nothing.

After the workers failed (:func:`launch`): a worker's ``OSError`` (a full disk, a
read-only store) comes back as the same :class:`~ringcore.WorkerError` with a message
that names the store, the last complete checkpoint (checked readable) and the fix.
"""

from __future__ import annotations

import contextlib
import io
import posixpath
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import cloudpickle
import numpy as np
import torch
from pyspark.sql import Column, DataFrame
from pyspark.sql import functions as F
from pyspark.sql.types import ArrayType, FractionalType

from ringcore import WorkerError

from ._columns import feature_expr, label_expr
from ._runs import record_run

__all__ = [
    "check_config",
    "check_data",
    "check_first_batch",
    "check_slots",
    "launch",
]

#: Rows of the first batch the driver runs through the model and the loss.
FIRST_BATCH_ROWS = 2


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
    if getattr(cfg, "framework", "torch") != "keras":
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


def check_slots(spark: Any, num_proc: int) -> None:
    """Fail with NotEnoughSlotsError (a ValueError) before the data is written when the
    cluster cannot hold ``num_proc`` barrier tasks (a cluster master waits for executors
    up to ``RING_SPARK_START_TIMEOUT``, as ``spark_runner.run`` does)."""
    from ringcore._config import get_float
    from spark_runner import DEFAULT_START_TIMEOUT_S, START_TIMEOUT_ENV_VAR
    from spark_runner._slots import wait_for_slots

    timeout = get_float(START_TIMEOUT_ENV_VAR, DEFAULT_START_TIMEOUT_S)
    wait_for_slots(spark.sparkContext, num_proc, timeout)


# --- one aggregation over the data ----------------------------------------------------------


def _selected(df: DataFrame, cfg: Any) -> list[tuple[str, str, Column]]:
    """``(role, name, expression)`` of every column the workers read, as they read it."""
    schema = df.schema
    columns = [("feature", c, feature_expr(schema[c])) for c in cfg.feature_cols]
    columns += [("label", c, label_expr(schema[c])) for c in cfg.label_cols]
    if cfg.sample_weight_col is not None:
        weight = cfg.sample_weight_col
        columns.append(("sample weight", weight, F.col(f"`{weight}`").cast("float").alias(weight)))
    return columns


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


def check_data(df: DataFrame, cfg: Any) -> None:
    """One Spark job over the columns fit reads: rows, nulls, NaNs, array lengths, and a
    first batch through the model and the loss. Raises ValueError naming the column."""
    selected = _selected(df, cfg)
    exprs = [expr for _, _, expr in selected]
    validation = isinstance(cfg.validation, str)
    if validation:
        marked = F.coalesce(F.col(f"`{cfg.validation}`").cast("boolean"), F.lit(False))
        exprs.append(marked.alias(_VAL))
    frame = df.select(*exprs)
    fields = frame.schema.fields[: len(selected)]
    stats = frame.agg(*_aggregations(frame, fields, validation)).first()
    if stats is None:
        return
    values = stats.asDict()
    _raise_for_rows(values, cfg)
    _raise_for_values(values, selected)
    check_first_batch(cfg, _batch_of([values["first"], values["last"]], fields))


# --- a first batch through the model and the loss ---------------------------------------------


def _shapes(batch: dict[str, Any]) -> str:
    return ", ".join(f"{k}: {tuple(np.shape(v))}" for k, v in batch.items())


def _loss_name(loss: Any) -> str:
    return getattr(loss, "__name__", None) or type(loss).__name__


def _call_loss(cfg: Any, output: torch.Tensor, target: torch.Tensor, label: str) -> None:
    from ._train_torch import _per_row_loss

    name = _loss_name(cfg.loss)
    shapes = (
        f"the model's output of shape {tuple(output.shape)} ({output.dtype}) and label column "
        f"{label!r} of shape {tuple(target.shape)} ({target.dtype})"
    )
    fix = (
        "Make the model return, per label column, what this loss takes (e.g. (rows, classes) "
        "logits for class-index labels with CrossEntropyLoss; the label's shape with MSELoss), "
        "or choose a loss for this label with setLoss(...)."
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if cfg.sample_weight_col is not None:
                value = _per_row_loss(cfg.loss, output, target)
            else:
                value = cfg.loss(output, target)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            raise ValueError(
                f"the loss {name} does not fit the label: on a first batch it got {shapes} and "
                f"raised {type(exc).__name__}: {reason}. {fix}"
            ) from exc
    sizes = [w for w in caught if "size" in str(w.message) and "target" in str(w.message)]
    if sizes:
        raise ValueError(
            f"the loss {name} does not fit the label: on a first batch it got {shapes} and would "
            f"broadcast them ({sizes[0].message}). {fix}"
        )
    if cfg.sample_weight_col is None and (
        not isinstance(value, torch.Tensor) or value.numel() != 1
    ):
        shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
        raise ValueError(
            f"the loss {name} returned {shape} for a first batch ({shapes}), not one number. "
            "Return the batch's mean (e.g. reduction='mean') from the loss set with setLoss(...)."
        )


def check_first_batch(cfg: Any, batch: dict[str, np.ndarray]) -> None:
    """Run ``batch`` (a few rows) through ``transformation_fn``, the model (in eval mode,
    without gradients; its mode is restored) and the loss, on the driver. Torch models
    only: a LightningModule's ``training_step`` runs on the workers."""
    if getattr(cfg, "framework", "torch") != "torch" or cfg.loss is None:
        return
    from ._train_torch import _as_target, as_outputs, to_inputs

    if cfg.transformation_fn is not None:
        try:
            batch = cfg.transformation_fn(dict(batch))
        except Exception as exc:
            raise ValueError(
                f"transformation_fn failed on a first batch ({_shapes(batch)}): "
                f"{type(exc).__name__}: {exc}. It takes and returns a dict of numpy arrays, one "
                "per column; fix it and pass it again with setTransformationFn(...)."
            ) from exc
    model, training = cfg.model, cfg.model.training
    model.eval()
    try:
        with torch.no_grad():
            inputs = to_inputs(batch, cfg.feature_cols)
            try:
                result = model(*inputs)
            except Exception as exc:
                shapes = ", ".join(str(tuple(t.shape)) for t in inputs)
                raise ValueError(
                    f"the model {type(model).__name__} failed on a first batch: forward got "
                    f"{len(inputs)} input(s) of shape {shapes} (feature_cols "
                    f"{cfg.feature_cols}, in that order) and raised {type(exc).__name__}: {exc}. "
                    "Make forward take those inputs, or change feature_cols (setFeatureCols)."
                ) from exc
            outputs = as_outputs(result, len(cfg.label_cols))
            for output, label in zip(outputs, cfg.label_cols, strict=True):
                target = _as_target(output, torch.from_numpy(np.array(batch[label])))
                _call_loss(cfg, output, target, label)
    finally:
        model.train(training)


# --- after the workers failed ---------------------------------------------------------------


def _os_error_names() -> set[str]:
    names, todo = set(), [OSError]
    while todo:
        cls = todo.pop()
        names.add(cls.__name__)
        todo.extend(cls.__subclasses__())
    return names


def _checkpoint_state(cfg: Any) -> str:
    path = cfg.store.find_checkpoint(cfg.run_id)
    if path is None:
        return f"No checkpoint of run {cfg.run_id!r} was written yet."
    try:
        checkpoint = torch.load(
            io.BytesIO(cfg.store.read_bytes(path)), weights_only=True, map_location="cpu"
        )
        epoch = int(checkpoint["epoch"])
    except Exception as exc:
        return f"The checkpoint at {path} cannot be read ({type(exc).__name__}: {exc})."
    return (
        f"The last complete checkpoint, epoch {epoch} of {cfg.epochs}, is intact at {path}; "
        f"fit again with run_id={cfg.run_id!r} to resume from it."
    )


def _store_problem(cfg: Any) -> str | None:
    """Why the run's checkpoint folder refuses a one-byte write now, or None if it takes it."""
    folder = cfg.store.get_checkpoints_path(cfg.run_id)
    probe = posixpath.join(folder, f".ringtrain-write-probe-{uuid.uuid4().hex[:8]}")
    try:
        cfg.store.write_bytes(probe, b"x")
    except OSError as exc:
        return exc.strerror or str(exc)
    finally:
        with contextlib.suppress(OSError):
            cfg.store.rm(probe)
    return None


def launch(launcher: Callable[..., list[Any]], fn: Any, args: tuple, cfg: Any) -> list[Any]:
    """``launcher(fn, args, num_proc)``; a failure caused by the store (a worker's OSError,
    or a store that refuses a write now) is explained (see the module docstring)."""
    if getattr(cfg, "run_params", None):  # what this run trains, before its first checkpoint
        record_run(cfg.store, cfg.run_id, cfg.run_params)
    try:
        return launcher(fn, args, cfg.num_proc)
    except WorkerError as err:
        problem = _store_problem(cfg)
        if problem is None and err.error_type not in _os_error_names():
            raise
        message = (
            f"{err.message} — the workers could not write to the store {cfg.store.prefix_path} "
            f"({problem or err.message}). Free space in it or restore write access. "
            f"{_checkpoint_state(cfg)}"
        )
        raise WorkerError(
            err.rank, err.host, err.error_type, message, err.traceback, err.output
        ) from err
