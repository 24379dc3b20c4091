"""The numpy linear model, its worker loop, its checkpoint and its Arrow predictor.

Everything a worker runs lives in this one module: spark_runner ships the worker
function's module by value to the Spark tasks (tests/ is not on their path).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from estimators.frameworks import DataSpec, Framework, checkpoint_writer, data_spec_fields


@dataclass
class LinearModel:
    """``y = x @ weights + bias`` on one array (or scalar) feature column, one label."""

    weights: np.ndarray
    bias: float = 0.0
    lr: float = 0.1


@dataclass(frozen=True, kw_only=True)
class LinearSpec(DataSpec):
    weights: list[float] = field(default_factory=list)
    bias: float = 0.0
    lr: float = 0.1


def _features(columns: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    parts = [np.asarray(columns[n], np.float64).reshape(len(columns[n]), -1) for n in names]
    return np.concatenate(parts, axis=1)


def _checkpoint(weights: np.ndarray, bias: float, epoch: int) -> bytes:
    return json.dumps({"weights": weights.tolist(), "bias": bias, "epoch": epoch}).encode()


def train_linear(spec: LinearSpec) -> list[dict[str, Any]] | None:
    """Full-batch gradient descent on this rank's shard; the gradient sums are added up
    over the ring each epoch, so every rank steps alike. Rank 0 writes the checkpoint
    and the history after each epoch, and returns the history."""
    import torch

    import ringcore.torch as hvd
    from ringcore.data import read_shard

    hvd.init()
    rank, size = hvd.rank(), hvd.size()
    columns = [*spec.feature_cols, *spec.label_cols]
    shard = read_shard(spec.train_path, rank=rank, size=size, columns=columns, reader=spec.reader)
    x, y = _features(shard, spec.feature_cols), np.asarray(shard[spec.label_cols[0]], np.float64)
    weights, bias = np.asarray(spec.weights, np.float64), float(spec.bias)
    writer = checkpoint_writer(spec)
    if rank == 0:
        spec.store.claim_run(spec.run_id, writer)
    history: list[dict[str, Any]] = []
    for epoch in range(spec.epochs):
        error = x @ weights + bias - y
        local = np.concatenate([x.T @ error, [error.sum(), (error**2).sum(), len(y)]])
        total = hvd.allreduce(torch.from_numpy(local), op=hvd.Sum, name=f"linear.{epoch}")
        total = total.numpy()
        rows = total[-1]
        weights = weights - spec.lr * 2 * total[: len(weights)] / rows
        bias = bias - spec.lr * 2 * total[-3] / rows
        history.append({"epoch": epoch + 1, "train_loss": float(total[-2] / rows)})
        if rank == 0:
            data = _checkpoint(weights, bias, epoch + 1)
            spec.store.write_checkpoint(spec.run_id, writer, lambda f, d=data: f.write(d))
            spec.store.write_json(spec.store.get_history_path(spec.run_id), history)
    return history if rank == 0 else None


def _predictor(
    weights: np.ndarray, bias: float, staged: list[str], keep: int, names: list[str]
) -> Any:
    def predict(batches: Iterable[Any]) -> Iterator[Any]:
        import numpy as np
        import pyarrow as pa

        for batch in batches:
            parts = []
            for name in staged:
                values = batch.column(batch.schema.get_field_index(name)).to_pylist()
                parts.append(np.asarray(values, np.float64).reshape(batch.num_rows, -1))
            x = np.concatenate(parts, axis=1) if batch.num_rows else np.zeros((0, len(weights)))
            out = pa.array(x @ weights + bias, type=pa.float64())
            yield pa.RecordBatch.from_arrays(
                [*batch.columns[:keep], out], names=batch.schema.names[:keep] + names
            )

    return predict


class NumpyLinearFramework(Framework):
    """The plug-in: its own worker loop, checkpoint and predictor; the rest is generic."""

    name = "numpy-linear"

    def worker(self, cfg: Any, data: Any) -> tuple[Any, tuple]:
        model = cfg.model
        spec = LinearSpec(
            **data_spec_fields(cfg, data),
            weights=list(np.asarray(model.weights, np.float64)),
            bias=float(model.bias),
            lr=float(model.lr),
        )
        return train_linear, (spec,)

    def checkpoint_epoch(self, data: bytes) -> int:
        return int(json.loads(data)["epoch"])

    def load_checkpoint(self, cfg: Any) -> LinearModel:
        path = cfg.store.find_checkpoint(cfg.run_id)
        saved = json.loads(cfg.store.read_bytes(path))
        return LinearModel(np.asarray(saved["weights"]), saved["bias"], cfg.model.lr)

    def predictor(
        self,
        model: Any,
        shapes: list[list[int]],
        staged: list[str],
        keep: int,
        names: list[str],
        use_gpu: bool | None,
    ) -> tuple[list[Any], Any]:
        from pyspark.sql.types import DoubleType

        weights = np.asarray(model.weights, np.float64)
        return [DoubleType()], _predictor(weights, float(model.bias), staged, keep, names)
