"""Keras callbacks, as Horovod's ``hvd.callbacks`` (Keras 3 on TensorFlow)."""

from __future__ import annotations

from typing import Any

import keras
import numpy as np

from .._ops import Max
from ..runtime import state as _state
from ..tensorflow._bridge import tf
from ..tensorflow._collectives import allreduce
from ..tensorflow._training import broadcast_variables, variable_key

__all__ = [
    "BestModelCheckpoint",
    "BroadcastGlobalVariablesCallback",
    "LearningRateScheduleCallback",
    "LearningRateWarmupCallback",
    "MetricAverageCallback",
    "model_variables",
]


def model_variables(model: Any) -> list[Any]:
    """The model's variables, then its optimizer's (once built), in a fixed order."""
    variables = list(model.variables)
    optimizer = getattr(model, "optimizer", None)
    if optimizer is not None and optimizer.built:
        variables += list(optimizer.variables)
    return variables


class BroadcastGlobalVariablesCallback(keras.callbacks.Callback):
    """At the start of training, every rank takes rank ``root_rank``'s weights and
    optimizer state. Keras 3 builds the optimizer in the first step (before
    ``on_train_begin`` only under a ``tf.distribute`` strategy), and a script may build or
    restore it on some ranks only: the ranks agree first (one small allreduce), a rank
    whose optimizer is unbuilt while another's is built builds its own, and then every
    rank broadcasts the same variables; when no rank's is built, the optimizer state
    follows after the first batch. ``local_variables`` keep each rank's own values."""

    def __init__(self, root_rank: int = 0, device: str = "", local_variables: Any = None):
        super().__init__()
        self.root_rank = root_rank
        self.local_variables = list(local_variables or [])
        self._optimizer_pending = False

    def _shared(self, variables: list[Any]) -> list[Any]:
        local = {variable_key(v) for v in self.local_variables}
        return [v for v in variables if variable_key(v) not in local]

    def on_train_begin(self, logs: Any = None) -> None:
        optimizer = getattr(self.model, "optimizer", None)
        if optimizer is not None:
            built = tf.constant([1 if optimizer.built else 0], dtype=tf.int32)
            any_built = int(allreduce(built, op=Max, name="keras.optimizer_built")[0])
            if any_built and not optimizer.built:  # built on another rank only: build here too
                optimizer.build(self.model.trainable_variables)
        broadcast_variables(self._shared(model_variables(self.model)), self.root_rank)
        self._optimizer_pending = optimizer is not None and not optimizer.built

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        if self._optimizer_pending:
            self._optimizer_pending = False
            variables = self._shared(list(self.model.optimizer.variables))
            broadcast_variables(variables, self.root_rank)


class MetricAverageCallback(keras.callbacks.Callback):
    """At the end of each epoch, replace every numeric metric in ``logs`` by its
    average over the ranks (one allreduce). Put it before callbacks that read logs."""

    def __init__(self, device: str = ""):
        super().__init__()

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is None or _state.size() == 1:
            return
        names = sorted(k for k, v in logs.items() if np.ndim(v) == 0 and _is_number(v))
        if not names:
            return
        values = tf.constant([float(logs[n]) for n in names], tf.float64)
        averaged = allreduce(values, name=f"ringcore.keras.metrics.{epoch}").numpy()
        logs.update({n: float(v) for n, v in zip(names, averaged, strict=True)})


def _is_number(value: Any) -> bool:
    try:
        float(value)
    except (TypeError, ValueError):
        return False
    return True


class LearningRateScheduleCallback(keras.callbacks.Callback):
    """Set the learning rate to ``initial_lr * multiplier(epoch)`` between
    ``start_epoch`` and ``end_epoch`` (``multiplier`` a number or a function of the
    epoch). With ``staircase=False`` and ``steps_per_epoch`` the epoch is fractional
    and the rate changes every batch. ``momentum_correction`` is accepted for
    Horovod's signature but has no effect: Keras 3 compiles momentum into the step."""

    def __init__(
        self,
        initial_lr: float,
        multiplier: Any,
        start_epoch: int = 0,
        end_epoch: int | None = None,
        staircase: bool = True,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ):
        super().__init__()
        if not callable(multiplier) and not isinstance(multiplier, int | float):
            raise TypeError(f"multiplier must be a number or fn(epoch), got {multiplier!r}")
        if not staircase and steps_per_epoch is None:
            raise ValueError("staircase=False needs steps_per_epoch= to know where an epoch ends")
        self.initial_lr, self.start_epoch, self.end_epoch = initial_lr, start_epoch, end_epoch
        self.multiplier = multiplier if callable(multiplier) else (lambda _epoch: multiplier)
        self.staircase, self.steps_per_epoch, self.verbose = staircase, steps_per_epoch, verbose
        self.momentum_correction = momentum_correction
        self._epoch = 0

    def _active(self, epoch: float) -> bool:
        return epoch >= self.start_epoch and (self.end_epoch is None or epoch < self.end_epoch)

    def _set(self, epoch: float) -> None:
        if self._active(epoch):
            self.model.optimizer.learning_rate = self.initial_lr * self.multiplier(epoch)

    def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
        self._epoch = epoch
        if self.staircase:
            self._set(epoch)

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        if not self.staircase and self.steps_per_epoch:
            self._set(self._epoch + batch / self.steps_per_epoch)

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if logs is not None:
            logs["lr"] = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))


class LearningRateWarmupCallback(LearningRateScheduleCallback):
    """Ramp the learning rate from ``initial_lr / size()`` to ``initial_lr`` over
    ``warmup_epochs`` (per batch when ``steps_per_epoch`` is given), as Horovod's
    warm-up for large effective batches (Goyal et al.)."""

    def __init__(
        self,
        initial_lr: float,
        warmup_epochs: int = 5,
        momentum_correction: bool = True,
        steps_per_epoch: int | None = None,
        verbose: int = 0,
    ):
        def multiplier(epoch: float) -> float:
            n = _state.size()
            return 1.0 / n * (epoch * (n - 1) / warmup_epochs + 1)

        super().__init__(
            initial_lr,
            multiplier,
            start_epoch=0,
            end_epoch=warmup_epochs,
            staircase=steps_per_epoch is None,
            momentum_correction=momentum_correction,
            steps_per_epoch=steps_per_epoch,
            verbose=verbose,
        )
        self.warmup_epochs = warmup_epochs

    def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
        if epoch == self.warmup_epochs - 1:
            self.model.optimizer.learning_rate = self.initial_lr
        super().on_epoch_end(epoch, logs)


class BestModelCheckpoint(keras.callbacks.ModelCheckpoint):
    """A ``ModelCheckpoint`` that keeps only the best model by ``monitor`` and writes
    on rank 0 only. ``filepath`` may be set later (the estimator sets it)."""

    def __init__(
        self,
        monitor: str = "val_loss",
        verbose: int = 0,
        mode: str = "auto",
        save_freq: Any = "epoch",
        filepath: str | None = None,
    ):
        super().__init__(
            filepath=filepath or "unset.keras",
            monitor=monitor,
            verbose=verbose,
            save_best_only=True,
            mode=mode,
            save_freq=save_freq,
        )
        self._filepath_set = filepath is not None

    def set_filepath(self, filepath: str) -> None:
        self.filepath, self._filepath_set = filepath, True

    def on_train_begin(self, logs: Any = None) -> None:
        if not self._filepath_set:
            raise ValueError(
                "BestModelCheckpoint has no filepath; pass filepath= or call set_filepath()"
            )
        super().on_train_begin(logs)

    def _save_model(self, *args: Any, **kwargs: Any) -> None:
        if not _state.is_initialized() or _state.rank() == 0:
            super()._save_model(*args, **kwargs)
