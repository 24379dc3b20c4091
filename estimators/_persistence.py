"""Spark ML persistence of a :class:`RingModel`: ``save(path)`` / ``RingModel.load(path)``.

Layout under ``path`` (a local path or a URL Spark and fsspec both understand)::

    <path>/metadata/          Spark ML's JSON metadata (DefaultParamsWriter): class, uid,
                              the JSON params (history, run_id, columns, label kinds,
                              feature shapes, the store's prefix) and ``ringtrain`` extras
    <path>/model/weights.pt   torch (and Lightning): torch.save of the module's state_dict
                              (+ non-persistent buffers; frameworks/torch/_checkpoint.py)
    <path>/model/module.pkl   torch: cloudpickle of the module's *structure*, its tensors
                              on the ``meta`` device (no weights)
    <path>/model/model.keras  Keras: the model in Keras's own format
    <path>/model/hf/          Hugging Face: save_pretrained (config.json, model.safetensors;
                              a PEFT model: its adapters and the base model's config.json)
    <path>/model/tokenizer/   Hugging Face: the tokenizer param's save_pretrained (and its class)
    <path>/model/params.pkl   the model's object params that its framework does not save in a
                              format of its own (Framework.save_model_params), cloudpickled

The framework (recorded in the metadata by name) writes and reads ``<path>/model/``
(``estimators.frameworks``: ``Framework.save_model`` / ``load_model``), so a model of a
framework registered by ``register_framework`` saves and loads as the built-in ones.

Why cloudpickle for the structure: a module's class is often defined in a notebook or a
training script that the loading process cannot import; cloudpickle stores such a class
by value and an importable one by reference, so both load. The weights themselves are
read with ``torch.load(weights_only=True)``, which runs no pickled code. Loading
``module.pkl`` does run pickled code: load only models you trust (as with any pickle).
A store's ``storage_options`` (credentials, often) are not saved; a loaded model's
store is re-created from its prefix alone.

Because the writer and reader follow ``DefaultParamsWriter``'s metadata, a fitted
``PipelineModel`` holding a ``RingModel`` saves and loads like any other.

On Spark Connect (pyspark 4.x) the same layout is written: the Connect server writes
``metadata/`` (through the session given to Spark ML's metadata writer, as pyspark's own
Connect writers do), this client writes ``model/``, and ``overwrite()`` asks the server
to remove the old folder (Spark ML's Connect helper, as ``PipelineModel`` does there).
So the path must be one the server and this client both reach (the same machine, a
shared filesystem, or an object store URL): a save whose ``metadata/`` this client
cannot see afterwards, or a load that finds the metadata but no ``model/``, raises
saying so. pyspark 3.5's metadata writer and reader need a SparkContext, so there a
Connect session is refused before anything is written.
"""

from __future__ import annotations

import json
import posixpath
from typing import Any

import cloudpickle
import fsspec
import pyspark
from pyspark.ml.util import DefaultParamsReader, DefaultParamsWriter, MLReader, MLWriter

from spark_runner import is_connect

from .frameworks._registry import framework_of, get_framework
from .store._store import Store

__all__ = ["RingEstimatorReader", "RingEstimatorWriter", "RingModelReader", "RingModelWriter"]

FORMAT_VERSION = 1
_PARAMS_FILE = "params.pkl"
_JSON_PARAMS = (
    "history",
    "run_id",
    "feature_cols",
    "label_cols",
    "label_kinds",
    "output_cols",
    "feature_shapes",
    "use_gpu",
    "max_length",
    "model_output",
)
# model params that are objects (a tokenizer): cloudpickled into <path>/model/params.pkl
_PICKLED_PARAMS = ("tokenizer",)


class RingModelWriter(MLWriter):
    """Writes a :class:`RingModel`; ``model.write().overwrite().save(path)`` replaces."""

    def __init__(self, instance: Any):
        super().__init__()
        self.instance = instance

    def _handleOverwrite(self, path: str) -> None:
        """``overwrite()``: remove ``path`` first, through the JVM (classic) or, on Spark
        Connect, through the server (Spark ML's Connect helper, as pyspark's own
        ``RemoteMLWriter`` does)."""
        spark = self.sparkSession
        if not is_connect(spark):
            super()._handleOverwrite(path)
            return
        _check_connect_persistence("save")
        from pyspark.ml.connect.readwrite import RemoteMLWriter  # pyspark >= 4.0

        RemoteMLWriter.handleOverwrite(path, True)

    def saveImpl(self, path: str) -> None:
        model = self.instance
        module = model.getModel()
        if module is None:
            raise ValueError("this RingModel holds no model to save; set it with setModel.")
        connect = is_connect(self.sparkSession)
        if connect:
            _check_connect_persistence("save")
        framework = framework_of(module)
        params: dict[str, Any] = {
            name: model.getOrDefault(name) for name in _JSON_PARAMS if model.isSet(name)
        }
        store = model.getStore()
        if store is not None:
            params["store"] = store.prefix_path
        extra = {
            "ringtrain": {
                "format": FORMAT_VERSION,
                "framework": framework.name,
                "module_class": f"{type(module).__module__}.{type(module).__qualname__}",
            }
        }
        framework.check_save(module)  # before anything is written
        DefaultParamsWriter.saveMetadata(
            model, path, _metadata_context(self.sparkSession), extraMetadata=extra, paramMap=params
        )
        if connect and not _client_sees(posixpath.join(path, "metadata")):
            raise FileNotFoundError(
                f"the Spark Connect server wrote the RingModel's metadata under {path!r}, but "
                "this client does not see it there, so the model's weights written here would "
                "end up apart from it. Save to a path the server and this client both reach: a "
                f"shared filesystem or an object store URL (s3://, gs://, ...).{_hint(path)}"
            )
        framework.save_model(module, path)  # under <path>/model/
        objects = {
            n: model.getOrDefault(n) for n in _PICKLED_PARAMS if model.getOrDefault(n) is not None
        }
        objects = framework.save_model_params(objects, path)  # the rest: pickled
        if objects:
            with fsspec.open(posixpath.join(path, "model", _PARAMS_FILE), "wb") as f:
                f.write(cloudpickle.dumps(objects))


def _metadata_context(spark: Any) -> Any:
    """What Spark ML's metadata reader and writer take: pyspark 3.5 wants the
    SparkContext (it calls ``sc.parallelize``), 4.x takes either, and a Spark Connect
    session has no SparkContext at all."""
    if is_connect(spark):
        return spark
    return spark.sparkContext


def _check_connect_persistence(what: str) -> None:
    """Refuse a Connect session where pyspark's Spark ML metadata writer and reader need a
    SparkContext (pyspark < 4.0), before anything is written or read."""
    major = int(pyspark.__version__.split(".")[0])
    if major < 4:
        raise RuntimeError(
            f"RingModel {what} on a Spark Connect session needs pyspark 4.0 or newer: "
            f"pyspark {pyspark.__version__}'s Spark ML metadata writer and reader need a "
            "SparkContext, which a Connect client does not have. Upgrade pyspark (client "
            f"and server), or {what} the model from a classic SparkSession."
        )


def _hint(path: str) -> str:
    """For a relative path: the server resolves it against its own working directory."""
    if "://" in path or posixpath.isabs(path) or path.startswith("dbfs:"):
        return ""
    return (
        f" {path!r} is relative: the server and this client each resolve it against their own "
        "working directory; pass an absolute path."
    )


def _client_sees(path: str) -> bool:
    fs, local = fsspec.core.url_to_fs(path)
    return bool(fs.exists(local))


class RingModelReader(MLReader[Any]):
    """Reads what :class:`RingModelWriter` wrote: ``RingModel.load(path)``."""

    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        """The RingModel saved at ``path``.

        This unpickles ``<path>/model/module.pkl`` (cloudpickle; a Keras model: its
        ``.keras`` file), which runs any code the file holds: load only models you
        trust, from a path only you can write (as ``torch.load(weights_only=False)``).
        ``PipelineModel.load`` of a pipeline holding a RingModel calls this."""
        connect = is_connect(self.sparkSession)
        if connect:
            _check_connect_persistence("load")
        metadata = DefaultParamsReader.loadMetadata(path, _metadata_context(self.sparkSession))
        version = metadata.get("ringtrain", {}).get("format")
        if version != FORMAT_VERSION:
            raise ValueError(
                f"{path} holds a RingModel of format {version!r}; this ringtrain reads format "
                f"{FORMAT_VERSION}. Load it with the ringtrain version that saved it."
            )
        params = dict(metadata["paramMap"])
        store = params.pop("store", None)
        # format 1 before Keras: torch; a name no framework is registered under raises
        framework = _framework(path, metadata["ringtrain"].get("framework", "torch"))
        if connect and not _client_sees(posixpath.join(path, "model")):
            raise FileNotFoundError(
                f"the Spark Connect server read a RingModel's metadata under {path!r}, but this "
                f"client finds no {posixpath.join(path, 'model')} beside it (the weights are "
                "written and read by the client). Load from the path the model was saved to, as "
                f"this client reaches it: a shared filesystem or an object store URL.{_hint(path)}"
            )
        module = framework.load_model(path)
        params.update(framework.load_model_params(path))
        fs, objects = fsspec.core.url_to_fs(posixpath.join(path, "model", _PARAMS_FILE))
        if fs.exists(objects):
            with fs.open(objects, "rb") as f:
                params.update(cloudpickle.loads(f.read()))
        instance = self.cls(model=module, **params)
        if store is not None:
            instance.setStore(Store.create(store))
        instance._resetUid(metadata["uid"])
        return instance


def _framework(path: str, name: str) -> Any:
    """The framework a saved model names; a ValueError naming the path when no framework
    is registered under that name (a plug-in not imported in this process)."""
    try:
        return get_framework(name)
    except ValueError as exc:
        raise ValueError(f"{path} holds a model of framework {name!r}, but {exc}") from exc


# --- the unfitted estimator --------------------------------------------------------------------

ESTIMATOR_FORMAT_VERSION = 1
_PARAMS_FILE = "params.pkl"
_OBJECTS_FILE = "objects.pkl"


def _json_able(value: Any) -> bool:
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return False
    return True


def _pickled_params(est: Any, names: list[str]) -> bytes:
    """The params in ``names``, cloudpickled together (the optimizer and an lr_scheduler
    keep pointing at the model's parameters); an unpicklable one is named."""
    values = {name: est.getOrDefault(name) for name in names}
    try:
        return cloudpickle.dumps(values)
    except Exception:
        for name, value in values.items():
            try:
                cloudpickle.dumps(value)
            except Exception as exc:
                setter = "set" + "".join(p[:1].upper() + p[1:] for p in name.split("_"))
                raise ValueError(
                    f"{name} ({type(value).__name__}) cannot be pickled, so the estimator cannot "
                    f"be saved: {type(exc).__name__}: {exc}. Keep unpicklable state (locks, "
                    f"threads, open files, a SparkSession) out of it, then pass it again with "
                    f"{setter}(...), or unset it before saving."
                ) from exc
        raise


class RingEstimatorWriter(MLWriter):
    """Writes an unfitted ``RingEstimator``: ``<path>/metadata/`` (Spark ML's JSON: the
    params that are plain data, the store's prefix) and ``<path>/objects.pkl``
    (cloudpickle of the others: model, optimizer, loss, callbacks, lr_scheduler, ...).
    Loading runs pickled code: load only estimators you trust."""

    def __init__(self, instance: Any):
        super().__init__()
        self.instance = instance

    def saveImpl(self, path: str) -> None:
        if is_connect(self.sparkSession):
            _check_connect_persistence("save")
        est = self.instance
        set_names = [p.name for p in est.params if est.isSet(p)]
        params: dict[str, Any] = {}
        pickled = []
        for name in set_names:
            value = est.getOrDefault(name)
            if name == "store":
                params[name] = value.prefix_path if value is not None else None
            elif _json_able(value):
                params[name] = value
            else:
                pickled.append(name)
        data = _pickled_params(est, pickled)
        extra = {"ringtrain": {"format": ESTIMATOR_FORMAT_VERSION, "pickled": pickled}}
        DefaultParamsWriter.saveMetadata(
            est, path, _metadata_context(self.sparkSession), extraMetadata=extra, paramMap=params
        )
        with fsspec.open(posixpath.join(path.rstrip("/"), _OBJECTS_FILE), "wb") as f:
            f.write(data)


class RingEstimatorReader(MLReader[Any]):
    """Reads what :class:`RingEstimatorWriter` wrote (``RingEstimator.load(path)``,
    ``Pipeline.load`` of a pipeline holding one)."""

    def __init__(self, cls: type):
        super().__init__()
        self.cls = cls

    def load(self, path: str) -> Any:
        if is_connect(self.sparkSession):
            _check_connect_persistence("load")
        metadata = DefaultParamsReader.loadMetadata(path, _metadata_context(self.sparkSession))
        version = metadata.get("ringtrain", {}).get("format")
        if version != ESTIMATOR_FORMAT_VERSION:
            raise ValueError(
                f"{path} holds a RingEstimator of format {version!r}; this ringtrain reads "
                f"format {ESTIMATOR_FORMAT_VERSION}. Load it with the ringtrain that saved it."
            )
        params = dict(metadata["paramMap"])
        store = params.pop("store", None)
        with fsspec.open(posixpath.join(path.rstrip("/"), _OBJECTS_FILE), "rb") as f:
            params.update(cloudpickle.loads(f.read()))
        instance = self.cls()
        instance._set(**params)
        if store is not None:
            instance.setStore(Store.create(store))
        instance._resetUid(metadata["uid"])
        return instance
