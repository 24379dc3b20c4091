"""Elastic training with TensorFlow, as ``horovod.tensorflow.elastic``.

::

    state = elastic.TensorFlowKerasState(model, optimizer, epoch=0, batch=0)

    @elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            ...
            state.commit()

The loop, the reset of the ring and ``ObjectState`` are those of
:mod:`ringcore.torch.elastic` (see there); the states here keep TensorFlow variables:
``commit()`` copies their values in memory, ``restore()`` assigns them back,
``sync()`` gives every rank rank 0's.
"""

from __future__ import annotations

from typing import Any

from ..torch.elastic import HostsUpdatedInterrupt, ObjectState, State, run
from ._bridge import tf
from ._training import broadcast_variables

__all__ = [
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TensorFlowKerasState",
    "TensorFlowState",
    "run",
]


class _VariablesState(ObjectState):
    """An :class:`ObjectState` that also keeps the values of a list of variables."""

    def _variables(self) -> list[Any]:
        raise NotImplementedError

    def save(self) -> None:
        self._saved_values = [tf.identity(v) for v in self._variables()]
        super().save()

    def restore(self) -> None:
        for var, value in zip(self._variables(), self._saved_values, strict=False):
            var.assign(value)
        super().restore()

    def sync(self) -> None:
        variables = self._variables()
        if variables:
            broadcast_variables(variables, root_rank=0)
        super().sync()  # saves, the variables included


class TensorFlowState(_VariablesState):
    """``variables`` (a list of ``tf.Variable``) and any other attributes
    (``TensorFlowState(variables, epoch=0)``; ``session`` is Horovod's TF1 argument,
    accepted and not used: TensorFlow 2 runs eagerly)."""

    def __init__(self, variables: Any = None, session: Any = None, **kwargs: Any):
        self.variables = list(variables) if variables is not None else []
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        return self.variables


class TensorFlowKerasState(_VariablesState):
    """A Keras model, its optimizer (``optimizer=`` or the one it was compiled with)
    and any other attributes. The optimizer's variables count once it is built."""

    def __init__(self, model: Any, optimizer: Any = None, backend: Any = None, **kwargs: Any):
        self.model = model
        self.optimizer = optimizer if optimizer is not None else getattr(model, "optimizer", None)
        super().__init__(**kwargs)

    def _variables(self) -> list[Any]:
        variables = list(self.model.variables)
        if self.optimizer is not None and getattr(self.optimizer, "built", False):
            variables += list(self.optimizer.variables)
        return variables
