"""Frameworks as plug-ins: what differs between kinds of models, one folder each.

A framework (:class:`Framework`) owns its params, the part of the fit's config it
reads, its training loop on the workers, its checkpoints, prediction, saving and its
MLflow flavour; the estimator finds a model's framework through the registry
(:func:`framework_of`) and never branches on one. Built in: ``torch`` (an
``nn.Module``), ``lightning`` (a LightningModule, under a real ``lightning.Trainer``)
``keras`` (a Keras 3 model) and ``huggingface`` (a ``transformers.PreTrainedModel``, in
the torch loop, called by name). Another is one folder and one register call::

    from estimators.frameworks import Framework, register_framework

    class MyFramework(Framework):
        name = "mine"
        def worker(self, cfg, data): ...
        def load_checkpoint(self, cfg): ...
        def predictor(self, model, shapes, staged, keep, names, use_gpu): ...

    register_framework("mine", MyFramework, detect=lambda m: isinstance(m, MyModel),
                       takes="a MyModel")

The worker gets the data half of its spec from :func:`data_spec_fields` (the Parquet
paths, the batching, the store and the run) and writes its checkpoint through the
store as :func:`checkpoint_writer` says (``Store.claim_run`` / ``write_checkpoint``).
"""

from ..data._spec import DataSpec, data_spec_fields
from ..data._spec import writer as checkpoint_writer
from ._base import Framework, Predictor
from ._registry import framework_of, get_framework, register_framework, registered_frameworks
from .huggingface import HuggingFaceFramework, is_hf_model
from .keras import KerasFramework, is_keras_model
from .lightning import LightningFramework, is_lightning_module
from .torch import TorchFramework, is_torch_module

__all__ = [
    "DataSpec",
    "Framework",
    "Predictor",
    "checkpoint_writer",
    "data_spec_fields",
    "framework_of",
    "get_framework",
    "register_framework",
    "registered_frameworks",
]

# Detection asks the newest registration first: a LightningModule is an nn.Module too.
register_framework("torch", TorchFramework, detect=is_torch_module, takes="a torch.nn.Module")
register_framework(
    "lightning", LightningFramework, detect=is_lightning_module, takes="a LightningModule"
)
register_framework("keras", KerasFramework, detect=is_keras_model, takes="a keras.Model")
register_framework(
    "huggingface",
    HuggingFaceFramework,
    detect=is_hf_model,
    takes="a transformers.PreTrainedModel",
)
