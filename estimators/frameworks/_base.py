"""What the estimator needs from a framework: one object per kind of model, a plug-in.

A :class:`Framework` owns everything that differs between kinds of models: the params
only it reads, its checks, its part of the fit's config, the function its workers
run, its checkpoints, prediction in ``transform``, saving and loading, and its MLflow
flavour. The fit path (``estimators/fit/``), ``RingModel`` and persistence call these
methods on the framework the registry finds for the model (``_registry``) and never
compare framework names. A new framework subclasses :class:`Framework`, overrides what
its models need (at least :meth:`~Framework.worker`, :meth:`~Framework.load_checkpoint`
and :meth:`~Framework.predictor`) and is registered with ``register_framework``.
``RingModel.transform`` calls :meth:`~Framework.model_predictor` (by default
:meth:`~Framework.predictor`), which also gets the ``RingModel``'s params (a tokenizer
the fit set through :meth:`~Framework.model_params`).

``cfg`` below is the fit's ``FitConfig`` (``estimators/fit/_config.py``), ``data`` its
``PreparedData``; ``cfg.framework_config`` holds what :meth:`Framework.resolve` returned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

__all__ = ["Framework", "Predictor"]

#: ``mapInArrow``'s function: Arrow batches in, the same batches with the outputs appended out.
Predictor = Callable[[Iterable[Any]], Iterable[Any]]


class Framework:
    """One kind of model the estimator trains (see the module docstring)."""

    #: the registry key (``register_framework``'s ``name``)
    name: str = ""
    #: whether the ``model`` param travels to the workers by cloudpickle (checked before any job)
    pickles_model: bool = True
    #: its models take typed inputs: integer feature columns reach them as int64 (token
    #: ids) and text columns as strings, instead of every feature as float32 (``data/_columns``)
    typed_features: bool = False
    #: the estimator params only this framework reads, each with the value that means unset;
    #: one set for a model of another framework is refused before any job (:meth:`refusal`)
    params: Mapping[str, Any] = MappingProxyType({})
    #: the ``RingModel`` params only this framework reads (unset: None); one set on a
    #: model of another framework is refused before transform runs
    reads_model_params: frozenset[str] = frozenset()

    def _missing(self, what: str) -> NotImplementedError:
        return NotImplementedError(
            f"the {self.name!r} framework does not {what}; its Framework subclass "
            f"{type(self).__name__} must override it"
        )

    # --- params: on the driver, before any job ------------------------------------------

    def refusal(self, name: str, value: Any, model: Framework) -> str:
        """The error for this framework's param ``name`` set to ``value`` when the model is
        ``model``'s (which does not read it); ``model.instead(name)`` says what to use."""
        instead = model.instead(name)
        return (
            f"{name}={value!r} is set, but only a {self.name} model reads it and the model "
            f"is a {model.name} model{': ' + instead if instead else ''}. Unset it "
            f"(setParams({name}={self.params[name]!r}))."
        )

    def instead(self, name: str) -> str | None:
        """Where a model of this framework sets what another framework's param ``name``
        does (None: nowhere to point to)."""
        return None

    def check_params(self, model: Any, optimizer: Any, loss: Any, metrics: Any) -> None:
        """Raise ValueError naming the param and its setter when these do not fit ``model``."""

    def resolve(self, params: Mapping[str, Any], cfg: Any) -> Any:
        """This framework's part of the fit's config (``cfg.framework_config``) from the
        estimator's ``params`` (None read as the param's default), checked: a ValueError
        names the param, the value and the fix. ``cfg`` is the rest of the config."""
        return None

    def check_resume(self, model: Any, store: Any, run_id: str, path: str) -> None:
        """Raise ValueError when ``model`` cannot resume the run's checkpoint at ``path``
        (a fit with that ``run_id`` would resume it)."""

    # --- data: on the driver, before the workers start ----------------------------------

    def check_first_batch(self, cfg: Any, batch: dict[str, Any]) -> None:
        """Run a few rows (``{column: ndarray}``) through the model and the loss on the
        driver, before any data is written; raise ValueError naming both shapes."""

    def check_prepared(self, cfg: Any, data: Any) -> None:
        """The last check before the workers start, on the prepared data's shapes."""

    # --- the workers --------------------------------------------------------------------

    def worker(self, cfg: Any, data: Any) -> tuple[Callable[..., Any], tuple]:
        """``(fn, args)``: the function every worker runs and its picklable arguments;
        rank 0 returns the history (one dict per epoch) and writes the run's checkpoint."""
        raise self._missing("train")

    # --- checkpoints and the trained model ----------------------------------------------

    def checkpoint_epoch(self, data: bytes) -> int:
        """The epochs done that a checkpoint of this framework (its bytes) holds."""
        raise self._missing("read its checkpoints' epoch")

    def load_checkpoint(self, cfg: Any) -> Any:
        """The trained model from the run's final checkpoint in the store."""
        raise self._missing("load its checkpoints")

    def model_params(self, cfg: Any) -> dict[str, Any]:
        """The ``RingModel`` params (``MODEL_PARAMS``) this framework's fit sets beyond
        the generic ones, e.g. what ``transform`` needs to call the model the same way."""
        return {}

    def predictor(
        self,
        model: Any,
        shapes: list[list[int]],
        staged: list[str],
        keep: int,
        names: list[str],
        use_gpu: bool | None,
    ) -> tuple[list[Any], Predictor]:
        """The Spark type of each output column and the per-task ``mapInArrow`` function
        (the first ``keep`` columns pass through; ``staged`` are the model's inputs, one
        per feature column in order)."""
        raise self._missing("predict")

    def model_predictor(
        self,
        model: Any,
        shapes: list[list[int]],
        staged: list[str],
        keep: int,
        names: list[str],
        use_gpu: bool | None,
        params: Mapping[str, Any],
    ) -> tuple[list[Any], Predictor]:
        """What ``RingModel.transform`` calls: :meth:`predictor`, for a framework that
        also reads the ``RingModel``'s ``params`` (by name: a tokenizer) to predict."""
        return self.predictor(model, shapes, staged, keep, names, use_gpu)

    def check_save(self, model: Any) -> None:
        """Raise, naming the fix, if :meth:`save_model` cannot save ``model``; called by
        ``RingModel.save`` before anything is written, so a refused save leaves nothing."""

    def save_model(self, model: Any, path: str) -> None:
        """Write the model under ``<path>/model/`` (``RingModel.save``)."""
        raise self._missing("save models")

    def load_model(self, path: str) -> Any:
        """Read what :meth:`save_model` wrote (``RingModel.load``)."""
        raise self._missing("load models")

    def save_model_params(self, params: Mapping[str, Any], path: str) -> dict[str, Any]:
        """Write those of the ``RingModel``'s object ``params`` (a tokenizer) that this
        framework keeps in a format of its own under ``<path>/model/``; the ones returned
        are cloudpickled into ``<path>/model/params.pkl`` (``RingModel.save``)."""
        return dict(params)

    def load_model_params(self, path: str) -> dict[str, Any]:
        """The params :meth:`save_model_params` wrote (``RingModel.load``)."""
        return {}

    def log_model(self, model: Any, name: str) -> str:
        """Log the trained model to the active MLflow run as artifact ``name``, in this
        framework's flavour; its model URI."""
        raise self._missing("log models to MLflow")
