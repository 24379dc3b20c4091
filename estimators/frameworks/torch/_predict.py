"""``RingModel.transform`` of a torch module (a LightningModule too), in Arrow batches.

:func:`torch_predictor` runs the module once on the driver, on one all-zero row, to
type each output column (``double`` for one value per row, else ``array<double>``),
and returns the function ``mapInArrow`` runs once per task: it unpickles the module
once, onto the task's device (:func:`task_device`), then runs one forward pass per
Arrow batch and appends the outputs to the batch's own columns.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import cloudpickle
import numpy as np
import pyarrow as pa
import torch
from pyspark.sql.types import ArrayType, DataType, DoubleType

from ringcore.data import to_numpy_columns
from ringcore.launch import check_use_gpu

from .._base import Predictor
from ._calling import ModelCall, inputs_to

__all__ = ["task_device", "torch_predictor"]


def _probe_outputs(
    model: torch.nn.Module, shapes: list[list[int]], staged: list[str], count: int, call: ModelCall
) -> list[DataType]:
    """Run ``model`` on one all-zero row: the Spark type of each output."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = call.outputs(call(model, call.probe(shapes, staged)), count)
    finally:
        model.train(was_training)
    return [
        DoubleType() if out.numel() == 1 else ArrayType(DoubleType(), containsNull=False)
        for out in outputs
    ]


def _to_arrow(output: torch.Tensor, rows: int, kind: DataType) -> pa.Array:
    values = output.detach().to("cpu", torch.float64).reshape(rows, -1).numpy()
    if isinstance(kind, DoubleType):
        return pa.array(values[:, 0], type=pa.float64())
    width = values.shape[1]
    offsets = pa.array(np.arange(0, rows * width + 1, width, dtype=np.int32))
    return pa.ListArray.from_arrays(offsets, pa.array(values.reshape(-1), type=pa.float64()))


def _empty(kind: DataType) -> pa.Array:
    return pa.array(
        [], type=pa.float64() if isinstance(kind, DoubleType) else pa.list_(pa.float64())
    )


def _predict_batch(
    model: torch.nn.Module,
    batch: pa.RecordBatch,
    staged: list[str],
    keep: int,
    names: list[str],
    kinds: list[DataType],
    device: torch.device,
    call: ModelCall,
) -> pa.RecordBatch:
    rows = batch.num_rows
    if rows == 0:
        outputs = [_empty(kind) for kind in kinds]
    else:
        with torch.no_grad():
            inputs = call.inputs(to_numpy_columns(batch, staged), staged)
            result = call(model, inputs_to(inputs, device))
        outputs = [
            _to_arrow(o, rows, k)
            for o, k in zip(call.outputs(result, len(names)), kinds, strict=True)
        ]
    return pa.RecordBatch.from_arrays(
        batch.columns[:keep] + outputs, names=batch.schema.names[:keep] + names
    )


def task_device(use_gpu: bool | None) -> torch.device:
    """The device a transform task predicts on. ``use_gpu`` None: a GPU when the task
    sees CUDA; True: a GPU or a clear error; False: the CPU. The GPU is the one Spark
    assigned to the task (``spark.task.resource.gpu.amount``), else ``partition % count``."""
    if not check_use_gpu(use_gpu, "RingModel.transform"):
        return torch.device("cpu")
    from pyspark import TaskContext

    ctx = TaskContext.get()
    gpus = ctx.resources().get("gpu") if ctx is not None else None
    if gpus is not None and gpus.addresses and gpus.addresses[0].isdigit():
        index = int(gpus.addresses[0])
    else:
        index = ctx.partitionId() if ctx is not None else 0
    return torch.device("cuda", index % torch.cuda.device_count())


def _make_predict(
    model_bytes: bytes,
    staged: list[str],
    keep: int,
    names: list[str],
    kinds: list[DataType],
    use_gpu: bool | None = None,
    call: ModelCall | None = None,
) -> Predictor:
    """The function ``mapInArrow`` runs once per task (so the model loads once per task,
    onto the task's device: :func:`task_device`)."""

    def predict(batches: Iterable[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        device = task_device(use_gpu)
        model = cloudpickle.loads(model_bytes).to(device)
        model.eval()
        for batch in batches:
            yield _predict_batch(
                model, batch, staged, keep, names, kinds, device, call or ModelCall()
            )

    return predict


def torch_predictor(
    model: Any,
    shapes: list[list[int]],
    staged: list[str],
    keep: int,
    names: list[str],
    use_gpu: bool | None,
    call: ModelCall | None = None,
) -> tuple[list[Any], Predictor]:
    """The output types (from one all-zero row) and the per-task ``mapInArrow`` function;
    ``call``: how the model is called (default: ``model(*features)``)."""
    call = call or ModelCall()
    kinds = _probe_outputs(model, shapes, staged, len(names), call)
    predict = _make_predict(cloudpickle.dumps(model), staged, keep, names, kinds, use_gpu, call)
    return kinds, predict
