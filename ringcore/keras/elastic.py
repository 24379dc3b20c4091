"""Elastic training with Keras, as ``horovod.tensorflow.keras.elastic``::

    state = elastic.KerasState(model, batch=0, epoch=0)
    callbacks = [
        elastic.CommitStateCallback(state),
        elastic.UpdateBatchStateCallback(state),
        elastic.UpdateEpochStateCallback(state),
    ]

    @elastic.run
    def train(state):
        model.fit(dataset, epochs=epochs - state.epoch, callbacks=callbacks)

    train(state)

``run`` and the state are those of :mod:`ringcore.tensorflow.elastic`.
"""

from __future__ import annotations

from typing import Any

import keras

from ..tensorflow.elastic import TensorFlowKerasState, run

__all__ = [
    "CommitStateCallback",
    "KerasState",
    "UpdateBatchStateCallback",
    "UpdateEpochStateCallback",
    "run",
]


class KerasState(TensorFlowKerasState):
    """A Keras model, its optimizer (``optimizer=`` or the compiled one) and any other
    attributes (``KerasState(model, epoch=0, batch=0)``), kept across ring changes."""

    def __init__(self, model: Any, optimizer: Any = None, **kwargs: Any):
        super().__init__(model, optimizer=optimizer, **kwargs)


class CommitStateCallback(keras.callbacks.Callback):
    """``state.commit()`` every ``batches_per_commit`` batches and at each epoch's end
    (the count starts again whenever training starts, so every rank commits together)."""

    def __init__(self, state: Any, batches_per_commit: int = 1):
        super().__init__()
        if not isinstance(batches_per_commit, int) or batches_per_commit < 1:
            raise ValueError(
                f"batches_per_commit must be an integer >= 1, got {batches_per_commit!r}"
            )
        self.state, self.batches_per_commit = state, batches_per_commit
        self._left = batches_per_commit

    def on_train_begin(self, logs: Any = None) -> None:
        self._left = self.batches_per_commit

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self._left -= 1
        if self._left == 0:
            self._left = self.batches_per_commit
            self.state.commit()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.commit()


class UpdateBatchStateCallback(keras.callbacks.Callback):
    """Keep ``state.batch`` at the number of the last batch done (0 again when an
    epoch ends)."""

    def __init__(self, state: Any):
        super().__init__()
        self.state = state

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.state.batch = batch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.batch = 0


class UpdateEpochStateCallback(keras.callbacks.Callback):
    """Keep ``state.epoch`` at the number of epochs done over every (re)start of
    training: Keras numbers the epochs of each ``fit`` from 0, this adds the epochs
    done before (so fit for ``epochs - state.epoch`` after a reset)."""

    def __init__(self, state: Any):
        super().__init__()
        self.state = state
        self._start = state.epoch

    def on_train_begin(self, logs: Any = None) -> None:
        self._start = self.state.epoch

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        self.state.epoch = self._start + epoch + 1
