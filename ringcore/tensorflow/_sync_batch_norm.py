"""``SyncBatchNormalization``: Keras 3 batch normalization with statistics over every
rank's batch, as ``horovod.tensorflow.SyncBatchNormalization``.

In training, each rank sums, per channel, its count of values, their sum and the sum
of their squares; one allreduce (Sum) of the three adds them up over the ranks, and
the mean and variance come from the totals. So ranks with batches of different sizes
weigh by their number of rows (as ``ringcore.torch.SyncBatchNorm``; Horovod's
TensorFlow layer averages the ranks' means as if their batches were equal). The
output, the moving statistics and the gradients equal those of
``keras.layers.BatchNormalization`` on the concatenation of every rank's batch: the
allreduce's gradient is the allreduce of the incoming gradients, so each rank's input
gradient takes in the other ranks' losses through the shared statistics. Outside
training (or on one rank) it is plain ``BatchNormalization``.
"""

from __future__ import annotations

from typing import Any

import keras

from .._ops import ReduceOp
from ..runtime import state as _state
from ._bridge import tf
from ._collectives import allreduce

__all__ = ["SyncBatchNormalization"]


@keras.saving.register_keras_serializable(package="ringcore")
class SyncBatchNormalization(keras.layers.BatchNormalization):
    """``keras.layers.BatchNormalization`` whose batch statistics span all ranks.

    Takes BatchNormalization's arguments; ``fused`` is Horovod's (only ``False``,
    its default: the layer is not fused) and Keras's ``synchronized`` (a
    ``tf.distribute`` strategy's replicas) does not apply: the ranks are the ring's.
    """

    def __init__(self, fused: Any = False, **kwargs: Any):
        if fused is not False:
            raise ValueError(
                f"SyncBatchNormalization does not support fused={fused!r}; leave fused "
                "unset (False): the statistics are computed unfused and allreduced"
            )
        if kwargs.pop("synchronized", False):
            raise ValueError(
                "SyncBatchNormalization(synchronized=True) is Keras's tf.distribute "
                "synchronization; this layer already synchronizes over the ring's ranks, "
                "leave synchronized unset"
            )
        super().__init__(**kwargs)

    def _moments(self, inputs: Any, mask: Any) -> tuple[Any, Any]:
        if _state.size() == 1:
            return super()._moments(inputs, mask)
        axes = self._reduction_axes
        if mask is None:
            weights = tf.ones_like(inputs)
        else:
            expanded = tf.cast(tf.expand_dims(mask, axis=-1), inputs.dtype)
            weights = tf.broadcast_to(expanded, tf.shape(inputs))
        local = tf.stack(
            [
                tf.reduce_sum(weights, axes),
                tf.reduce_sum(inputs * weights, axes),
                tf.reduce_sum(inputs * inputs * weights, axes),
            ]
        )
        count, total, squares = tf.unstack(allreduce(local, op=ReduceOp.Sum))
        count = tf.maximum(count, 1.0)  # a channel no rank has a value for: mean 0, var 0
        mean = total / count
        variance = tf.maximum(squares / count - tf.square(mean), 0.0)
        return mean, variance
