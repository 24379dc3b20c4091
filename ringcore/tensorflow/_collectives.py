"""Collectives on TensorFlow tensors, as Horovod's ``horovod.tensorflow`` offers them.

Each op checks its arguments when it is called (or traced), then runs on the same
engine as ``ringcore.torch`` (see ``_bridge`` for how tensors cross and what is
copied). Floating-point ops carry Horovod's gradients through ``tf.custom_gradient``:

- allreduce: the allreduce of the incoming gradient (same op and scale factors);
- allgather: the average of the incoming gradients over ranks, this rank's rows of it;
- broadcast: the average of the incoming gradients on the root, zeros elsewhere;
- alltoall: the incoming gradient sent back along the received splits;
- reducescatter: the allgather of the incoming gradient (times the set's size for
  Sum, as Horovod defines it), times the scale factors.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import torch as C
from .._ops import ReduceOp, resolve_op
from ..runtime import state as _state
from ..runtime.process_sets import ProcessSet, check_process_set, global_process_set
from ._bridge import run_op, tf, to_tf, to_torch
from ._compression import Compression

__all__ = [
    "allgather",
    "allgather_object",
    "allreduce",
    "alltoall",
    "barrier",
    "broadcast",
    "broadcast_object",
    "grouped_allreduce",
    "join",
    "reducescatter",
]

allgather_object = C.allgather_object


def broadcast_object(
    obj: Any = None,
    root_rank: int = 0,
    session: Any = None,
    name: str | None = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Rank ``root_rank``'s ``obj`` (pickled with cloudpickle) on every rank
    (``session`` is accepted for Horovod's signature and not used)."""
    return C.broadcast_object(obj, root_rank, name, process_set)


def _floating(tensor: Any) -> bool:
    return tensor.dtype.is_floating or tensor.dtype.is_complex


def _set_size(process_set: ProcessSet) -> int:
    return (process_set or global_process_set).size()


def _rows_unknown(like: Any) -> Any:
    """The static shape of an op whose first dimension changes (allgather and co.):
    ``like``'s, its first dimension unknown (an unknown rank stays unknown)."""
    if like.shape.rank is None:
        return tf.TensorShape(None)
    return tf.TensorShape([None, *like.shape[1:]])


# -- allreduce ------------------------------------------------------------------------------


def _allreduce_raw(tensor, op, pre, post, process_set, name):
    def eager(x):
        return to_tf(
            C.synchronize(C.allreduce_async(to_torch(x), None, name, op, pre, post, process_set))
        )

    return run_op(eager, [tensor], tensor.dtype, "RingAllreduce", shape=tensor.shape)


def _allreduce_diff(tensor, op, pre, post, process_set, name):
    if not _floating(tensor):
        return _allreduce_raw(tensor, op, pre, post, process_set, name)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            return _allreduce_raw(dy, op, pre, post, process_set, None)

        return _allreduce_raw(x, op, pre, post, process_set, name), grad

    return fn(tensor)


def _check_allreduce(op: ReduceOp, tensor: Any, process_set: ProcessSet) -> int:
    ps = check_process_set(process_set, "allreduce")
    if tensor.dtype == tf.bool and op not in (ReduceOp.Min, ReduceOp.Max):
        raise TypeError(f"allreduce of a bool tensor supports op=Min or Max, not {op.name}")
    if op == ReduceOp.Adasum and not tensor.dtype.is_floating:
        raise TypeError(f"op=Adasum needs a floating-point tensor, got {tensor.dtype.name}")
    return ps


def _sparse_allreduce(slices, op, process_set, name):
    """IndexedSlices as Horovod reduces them: gather every rank's values and indices."""
    if op not in (ReduceOp.Average, ReduceOp.Sum):
        raise NotImplementedError(
            f"allreduce of tf.IndexedSlices supports op=Average or Sum, not {op.name}; "
            "convert it with tf.convert_to_tensor to reduce it as a dense tensor"
        )
    values = allgather(slices.values, None if name is None else f"{name}.values", process_set)
    indices = allgather(slices.indices, None if name is None else f"{name}.indices", process_set)
    if op == ReduceOp.Average:
        values = values / tf.cast(_set_size(process_set), values.dtype)
    return tf.IndexedSlices(values, indices, dense_shape=slices.dense_shape)


def allreduce(
    tensor,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    name=None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope=False,
):
    """The reduction of ``tensor`` over all ranks (Average by default), as a new tensor.
    ``tf.IndexedSlices`` are gathered (values and indices) as Horovod does."""
    rop = resolve_op(average, op)
    if isinstance(tensor, tf.IndexedSlices):
        check_process_set(process_set, "allreduce")
        if prescale_factor != 1.0 or postscale_factor != 1.0:
            raise NotImplementedError(
                "allreduce of tf.IndexedSlices does not take prescale_factor or "
                f"postscale_factor (got {prescale_factor}, {postscale_factor}); scale the "
                "values yourself or convert it with tf.convert_to_tensor"
            )
        return _sparse_allreduce(tensor, rop, process_set, name)
    tensor = tf.convert_to_tensor(tensor)
    _check_allreduce(rop, tensor, process_set)
    compressed, ctx = compression.compress(tensor)
    out = _allreduce_diff(
        compressed, rop, float(prescale_factor), float(postscale_factor), process_set, name
    )
    return compression.decompress(out, ctx)


def _grouped_raw(tensors, op, pre, post, process_set, name):
    def eager(*xs):
        handle = C.grouped_allreduce_async(
            [to_torch(x) for x in xs], None, name, op, pre, post, process_set
        )
        return [to_tf(t) for t in C.synchronize(handle)]

    dtypes, shapes = [t.dtype for t in tensors], [t.shape for t in tensors]
    return list(run_op(eager, tensors, dtypes, "RingGroupedAllreduce", shape=shapes))


def _grouped_diff(tensors, op, pre, post, process_set, name):
    if not all(_floating(t) for t in tensors):
        return _grouped_raw(tensors, op, pre, post, process_set, name)

    @tf.custom_gradient
    def fn(*xs):
        def grad(*dys):
            return _grouped_raw(list(dys), op, pre, post, process_set, None)

        return _grouped_raw(list(xs), op, pre, post, process_set, name), grad

    return list(fn(*tensors))


def grouped_allreduce(
    tensors,
    average=None,
    device_dense="",
    device_sparse="",
    compression=Compression.none,
    op=None,
    prescale_factor=1.0,
    postscale_factor=1.0,
    process_set: ProcessSet = global_process_set,
    name=None,
):
    """Reduce a list of tensors as one fused unit; returns new tensors in order."""
    if not isinstance(tensors, list | tuple) or not tensors:
        raise TypeError("grouped_allreduce takes a non-empty list of tensors")
    rop = resolve_op(average, op)
    sparse = [i for i, t in enumerate(tensors) if isinstance(t, tf.IndexedSlices)]
    if sparse:  # as Horovod: the IndexedSlices gathered, the dense ones fused
        check_process_set(process_set, "grouped_allreduce")
        out = list(tensors)
        for i in sparse:
            out[i] = allreduce(
                tensors[i],
                op=rop,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                process_set=process_set,
                name=None if name is None else f"{name}.{i}",
            )
        dense = [i for i in range(len(tensors)) if i not in sparse]
        if dense:
            reduced = grouped_allreduce(
                [tensors[i] for i in dense],
                compression=compression,
                op=rop,
                prescale_factor=prescale_factor,
                postscale_factor=postscale_factor,
                process_set=process_set,
                name=name,
            )
            for i, r in zip(dense, reduced, strict=True):
                out[i] = r
        return out
    tensors = [tf.convert_to_tensor(t) for t in tensors]
    for t in tensors:
        _check_allreduce(rop, t, process_set)
    packed = [compression.compress(t) for t in tensors]
    outs = _grouped_diff(
        [p[0] for p in packed],
        rop,
        float(prescale_factor),
        float(postscale_factor),
        process_set,
        name,
    )
    return [compression.decompress(o, ctx) for o, (_, ctx) in zip(outs, packed, strict=True)]


# -- allgather, broadcast, alltoall, reducescatter ----------------------------------------------


def _allgather_raw(tensor, process_set, name):
    def eager(x):
        return to_tf(C.synchronize(C.allgather_async(to_torch(x), name, process_set)))

    return run_op(eager, [tensor], tensor.dtype, "RingAllgather", shape=_rows_unknown(tensor))


def allgather(
    tensor, name=None, ignore_name_scope=False, process_set: ProcessSet = global_process_set
):
    """Concatenate every rank's tensor along dim 0 (first dimensions may differ)."""
    tensor = tf.convert_to_tensor(tensor)
    check_process_set(process_set, "allgather")
    if tensor.shape.rank == 0:
        raise ValueError(
            "allgather needs a tensor with at least one dimension; use tf.reshape(x, [1])"
        )
    if not _floating(tensor):
        return _allgather_raw(tensor, process_set, name)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            reduced = _allreduce_raw(dy, ReduceOp.Average, 1.0, 1.0, process_set, None)
            rows = tf.shape(x, out_type=tf.int64)[:1]
            counts = _allgather_raw(rows, process_set, None)
            offset = tf.reduce_sum(counts[: (process_set or global_process_set).rank()])
            return reduced[offset : offset + rows[0]]

        return _allgather_raw(x, process_set, name), grad

    return fn(tensor)


def _check_root(root_rank: int, process_set: ProcessSet) -> None:
    ps = process_set or global_process_set
    members = ps.ranks if ps.ranks is not None else list(range(_state.size()))
    if root_rank not in members:
        raise ValueError(
            f"broadcast root_rank={root_rank} is not a rank of {ps!r} (ranks {list(members)})"
        )


def _broadcast_raw(tensor, root_rank, process_set, name):
    def eager(x):
        return to_tf(C.synchronize(C.broadcast_async(to_torch(x), root_rank, name, process_set)))

    return run_op(eager, [tensor], tensor.dtype, "RingBroadcast", shape=tensor.shape)


def broadcast(
    tensor,
    root_rank,
    name=None,
    ignore_name_scope=False,
    process_set: ProcessSet = global_process_set,
):
    """Rank ``root_rank``'s ``tensor``, on every rank, as a new tensor."""
    tensor = tf.convert_to_tensor(tensor)
    check_process_set(process_set, "broadcast")
    _check_root(root_rank, process_set)
    if not _floating(tensor):
        return _broadcast_raw(tensor, root_rank, process_set, name)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            reduced = _allreduce_raw(dy, ReduceOp.Average, 1.0, 1.0, process_set, None)
            return reduced if _state.rank() == root_rank else reduced * 0

        return _broadcast_raw(x, root_rank, process_set, name), grad

    return fn(tensor)


def _alltoall_raw(tensor, splits, process_set, name):
    def eager(x, s):
        out, received = C.synchronize(C.alltoall_async(to_torch(x), to_torch(s), name, process_set))
        return to_tf(out), to_tf(received.to(torch.int32))

    shapes = [_rows_unknown(tensor), tf.TensorShape([_set_size(process_set)])]
    out, received = run_op(
        eager, [tensor, splits], [tensor.dtype, tf.int32], "RingAlltoall", shape=shapes
    )
    return out, received


def alltoall(
    tensor,
    splits=None,
    name=None,
    ignore_name_scope=False,
    process_set: ProcessSet = global_process_set,
):
    """Send ``splits[i]`` rows to rank i (equal parts without ``splits``). As Horovod's
    TensorFlow op: returns the received tensor, and with ``splits`` given, the received
    splits (int32) too."""
    tensor = tf.convert_to_tensor(tensor)
    check_process_set(process_set, "alltoall")
    given = splits is not None
    if given:
        splits = tf.cast(tf.reshape(tf.convert_to_tensor(splits), [-1]), tf.int32)
    else:
        splits = _equal_splits(tensor, _set_size(process_set))
    if not _floating(tensor):
        out, received = _alltoall_raw(tensor, splits, process_set, name)
    else:

        @tf.custom_gradient
        def fn(x):
            out, received = _alltoall_raw(x, splits, process_set, name)

            def grad(dy, _dsplits=None):
                back, _ = _alltoall_raw(dy, tf.stop_gradient(received), process_set, None)
                return back

            return (out, received), grad

        out, received = fn(tensor)
    return (out, received) if given else out


def _equal_splits(tensor: Any, n: int) -> Any:
    """``n`` equal splits of the first dimension; InvalidArgumentError (as Horovod's op)
    when it does not divide by ``n``."""
    if tensor.shape.rank == 0:
        raise tf.errors.InvalidArgumentError(
            None, None, "alltoall needs a tensor with at least one dimension"
        )
    rows = tensor.shape[0] if tensor.shape.rank is not None else None
    if rows is None and tf.executing_eagerly():
        rows = int(tf.shape(tensor)[0])
    if rows is not None and rows % n:
        raise tf.errors.InvalidArgumentError(
            None,
            None,
            f"alltoall without splits needs the first dimension ({rows}) to divide by the "
            f"number of ranks ({n}); pass splits= to send uneven parts",
        )
    return tf.fill([n], tf.shape(tensor, out_type=tf.int32)[0] // n)


def _reducescatter_raw(tensor, op, pre, post, process_set, name):
    def eager(x):
        return to_tf(
            C.synchronize(C.reducescatter_async(to_torch(x), name, op, process_set, pre, post))
        )

    shape = _rows_unknown(tensor)
    return run_op(eager, [tensor], tensor.dtype, "RingReducescatter", shape=shape)


def reducescatter(
    tensor,
    device_dense="",
    compression=Compression.none,
    op=ReduceOp.Average,
    name=None,
    process_set: ProcessSet = global_process_set,
    ignore_name_scope=False,
    prescale_factor=1.0,
    postscale_factor=1.0,
):
    """Reduce across ranks and keep this rank's slice of dim 0 (the first
    ``rows % size`` ranks get one row more, as Horovod splits)."""
    tensor = tf.convert_to_tensor(tensor)
    check_process_set(process_set, "reducescatter")
    rop = ReduceOp(int(op))
    if tensor.shape.rank == 0:
        raise ValueError("reducescatter needs a tensor with at least one dimension")
    if rop not in (ReduceOp.Average, ReduceOp.Sum, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product):
        raise ValueError(
            f"reducescatter supports Average, Sum, Min, Max and Product, not {rop.name}"
        )
    compressed, ctx = compression.compress(tensor)
    pre, post = float(prescale_factor), float(postscale_factor)
    if not _floating(compressed):
        out = _reducescatter_raw(compressed, rop, pre, post, process_set, name)
        return compression.decompress(out, ctx)

    @tf.custom_gradient
    def fn(x):
        def grad(dy):
            gathered = _allgather_raw(dy, process_set, None)
            scale = pre * post * (_set_size(process_set) if rop == ReduceOp.Sum else 1)
            return gathered * tf.cast(scale, gathered.dtype)

        return _reducescatter_raw(x, rop, pre, post, process_set, name), grad

    return compression.decompress(fn(compressed), ctx)


# -- join, barrier ------------------------------------------------------------------------------


def join() -> Any:
    """Declare this rank out of data (the others' allreduces go on with zeros from it);
    returns the last rank to join, as an int32 tensor."""

    def eager():
        return tf.constant(C.join(), tf.int32)

    return run_op(eager, [], tf.int32, "RingJoin", shape=[])


def barrier(process_set: ProcessSet = global_process_set) -> Any:
    """Wait until every rank of ``process_set`` reaches the barrier."""
    check_process_set(process_set, "barrier")

    def eager():
        C.barrier(process_set)
        return tf.constant(0, tf.int32)

    return run_op(eager, [], tf.int32, "RingBarrier", shape=[])
