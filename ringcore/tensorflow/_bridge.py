"""How TensorFlow tensors reach the engine, and how ops run inside ``tf.function``.

The engine (``ringcore.engine``) runs on torch tensors over Gloo. A TensorFlow CPU
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

Error classes in a graph: TensorFlow turns an exception raised inside a
``py_function`` into ``InvalidArgumentError`` or ``UnknownError`` whatever its class,
but Horovod's kernels fail a mismatch between ranks with ``FailedPreconditionError``,
and code written against Horovod catches that. So in a graph the ``py_function``
does not raise a mismatch: it returns empty outputs and the message as one more
(string) output, and a guard after it fails the step with the right class. The
guard is a ``tf.io.read_file`` of ``/dev/null/<message>``, run only when the
message is not empty: reading below a file that is not a directory is the one
stock TensorFlow op that fails with ``FailedPreconditionError`` and a message made
at run time (ENOTDIR maps to FAILED_PRECONDITION), so the user sees that class with
our message in it, and no custom kernel has to be compiled. Outputs are read
through an identity that depends on the guard, so nothing downstream sees the
empty placeholders.
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
    a TF1 session) the step fails with a plain ``FailedPreconditionError`` carrying
    the same message (see the module docstring)."""

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


# Longest message carried into the guard's path (Linux refuses paths over 4096
# bytes with ENAMETOOLONG, which TensorFlow maps to another class).
_GUARD_MESSAGE_BYTES = 3000
_GUARD_PREFIX = "/dev/null/ringtrain: "


def _carrying_mismatch(fn: Callable[..., Any], touts: list[Any]) -> Callable[..., Any]:
    """``fn`` for a graph's ``py_function``: its outputs plus an empty message, or on a
    mismatch between ranks, empty outputs of each dtype plus the message."""

    def wrapper(*args: Any) -> list[Any]:
        try:
            out = fn(*args)
        except CollectiveMismatchError as exc:
            message = str(exc).replace("\0", " ").encode()[:_GUARD_MESSAGE_BYTES]
            empty = [tf.zeros([0], dtype=d) for d in touts]
            return [*empty, tf.constant(message.decode(errors="ignore"))]
        outs = list(out) if isinstance(out, list | tuple) else [out]
        return [*outs, tf.constant("")]

    return wrapper


def _guard(message: Any) -> Any:
    """An op that fails with ``FailedPreconditionError`` carrying ``message`` when it is
    not empty, and does nothing otherwise (see the module docstring)."""

    def fail() -> Any:
        # a data dependency on the read (a control one is pruned from the branch)
        read = tf.io.read_file(tf.strings.join([_GUARD_PREFIX, message]))
        return tf.equal(tf.strings.length(read), -1)

    return tf.cond(tf.equal(message, ""), lambda: tf.constant(True), fail)


def run_op(
    fn: Callable[..., Any],
    inputs: Sequence[Any],
    tout: Any,
    op_name: str,
    *,
    shape: Any,
) -> Any:
    """``fn(*inputs)`` now when eager; in a graph, a ``tf.py_function`` chained after
    the graph's previous collective, whose mismatch errors fail the step as
    ``FailedPreconditionError`` (see the module docstring).

    ``shape`` is the static shape of the output (a list of them when ``tout`` is a
    list; ``None`` in a dimension the op does not know before it runs). A
    ``py_function``'s outputs have no static shape, not even a rank, so the graph's
    outputs get this one: a Keras 3 ``Variable.assign`` of a broadcast value, a
    ``tf.reshape`` or a layer built on the result need it at trace time."""
    fn = _tf_errors(fn)
    if tf.executing_eagerly():
        return fn(*inputs)
    single = not isinstance(tout, list | tuple)
    touts = [tout] if single else list(tout)
    shapes = [shape] if single else list(shape)
    graph = tf.compat.v1.get_default_graph()
    previous = _chains.get(graph)
    with tf.control_dependencies([previous] if previous is not None else []):
        raw = tf.py_function(
            _carrying_mismatch(fn, touts), list(inputs), [*touts, tf.string], name=op_name
        )
        ok = _guard(raw[-1])
    with tf.control_dependencies([ok]):
        outs = [tf.identity(o) for o in raw[:-1]]
    for out, static in zip(outs, shapes, strict=True):
        out.set_shape(static)
    _chains[graph] = ok.op
    return outs[0] if single else outs
