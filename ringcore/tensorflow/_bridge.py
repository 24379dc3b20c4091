"""How TensorFlow tensors reach the engine, and how ops run inside ``tf.function``.

The engine (``ringcore._engine``) runs on torch tensors over Gloo. A TensorFlow CPU
tensor crosses to torch through DLPack, which shares the buffer (no copy); the
result crosses back the same way. The copies that remain:

- the out-of-place ops (allreduce, broadcast, reducescatter) copy their input once
  into the buffer the backend reduces in place — TensorFlow tensors are immutable,
  so the input buffer cannot be the output (Horovod's TF kernels allocate an
  output too); allgather and alltoall read the input where it lies;
- a fused allreduce copies into and out of the fusion buffer (as for torch);
- ``bool`` tensors travel as ``uint8`` (Gloo has no bool), one cast each way;
- where DLPack refuses a tensor (a dtype or layout it does not carry), the tensor
  goes through numpy instead (one copy each way).

In graph mode (inside ``tf.function``) every collective becomes a
``tf.py_function`` that runs the eager op when the graph executes. The collectives
of one graph are chained by control dependencies in the order they were traced, so
every rank runs them in the same order whatever TensorFlow's scheduler does: a
blocked ``py_function`` can never wait on a peer that waits on another op (the
engine would sort out the order, but TensorFlow's inter-op threads could all be
blocked). Unnamed ops are named at execution time from the engine's per-kind
counters, which ranks running the same program share. The same holds in a TF1
session graph (``tf.compat.v1``), where it has a cost: ``session.run`` runs what a
fetch depends on, so fetching a collective runs every one built before it in that
graph again (Horovod's asynchronous kernels need no such chain; a ``py_function``
blocks a thread, and independent blocked ones could deadlock the ranks).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

try:
    import tensorflow as tf
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "ringcore.tensorflow and ringcore.keras need TensorFlow, which is not installed; "
        "install it with: pip install 'ringtrain[tensorflow]'"
    ) from exc
import functools

import torch
import torch.utils.dlpack

from .._errors import CollectiveMismatchError

__all__ = ["MismatchError", "run_op", "to_tf", "to_torch"]


class MismatchError(tf.errors.FailedPreconditionError, CollectiveMismatchError):
    """Ranks disagree on a collective (shape, dtype, op, root rank): in eager mode,
    the ``tf.errors.FailedPreconditionError`` Horovod's TensorFlow ops raise, and
    still a :class:`ringcore.CollectiveMismatchError`. Inside a graph (``tf.function``,
    a TF1 session) the op is a ``tf.py_function``, which keeps no error class of
    the Python code but ValueError's: there it is an ``InvalidArgumentError`` with the
    same message."""

    def __init__(self, message: str):
        tf.errors.FailedPreconditionError.__init__(self, None, None, message)

    def __reduce__(self):
        return (type(self), (self.message,))


def _tf_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` raising a mismatch between ranks as :class:`MismatchError`."""

    @functools.wraps(fn)
    def wrapper(*args: Any) -> Any:
        try:
            return fn(*args)
        except CollectiveMismatchError as exc:
            if isinstance(exc, MismatchError):
                raise
            raise MismatchError(str(exc)) from exc

    return wrapper


_chains: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def to_torch(tensor: Any) -> torch.Tensor:
    """A torch view of an eager TensorFlow tensor (its buffer, shared through DLPack)."""
    tensor = tf.convert_to_tensor(tensor)
    try:
        return torch.from_dlpack(tf.experimental.dlpack.to_dlpack(tensor))
    except Exception:  # a dtype or device DLPack does not carry here: go through numpy
        array = tensor.numpy()
        return torch.from_numpy(array if array.flags.writeable else array.copy())


def to_tf(tensor: torch.Tensor) -> Any:
    """The torch result as a TensorFlow tensor, sharing its buffer where DLPack allows."""
    if not tensor.is_contiguous():
        tensor = tensor.contiguous()
    try:
        return tf.experimental.dlpack.from_dlpack(torch.utils.dlpack.to_dlpack(tensor))
    except Exception:
        return tf.convert_to_tensor(tensor.numpy())


def run_op(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    tout: Any,
    op_name: str,
) -> Any:
    """``fn(*inputs)`` now when eager; in a graph, a ``tf.py_function`` chained after
    the graph's previous collective (see the module docstring)."""
    fn = _tf_errors(fn)
    if tf.executing_eagerly():
        return fn(*inputs)
    graph = tf.compat.v1.get_default_graph()
    previous = _chains.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        out = tf.py_function(fn, list(inputs), tout, name=op_name)
    first = out[0] if isinstance(out, list | tuple) else out
    _chains[graph] = first.op if first is not None else None
    return out
