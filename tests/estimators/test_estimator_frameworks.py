"""The framework registry: one folder per framework, reached through the registry, never by branching.

``estimators.frameworks`` maps a name to the :class:`Framework` that checks, trains,
loads, predicts with and saves models of that framework, and finds a model's framework
(``framework_of``). These tests pin the seam: every built-in framework overrides the
whole interface with its signatures, detection asks the newest registration first, a
param only another framework reads is refused with that framework's message, no module
outside ``frameworks/`` compares framework names or identities, a torch fit imports
neither Keras nor Lightning, and the torch framework's save / load and predictor
round-trip a model. ``test_estimator_plugin.py`` fits a framework registered from
outside the package.
"""

from __future__ import annotations

import ast
import inspect
import json
import pathlib
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pytest
import torch

from estimators.fit._resolve import refuse_foreign_params
from estimators.frameworks import (
    Framework,
    framework_of,
    get_framework,
    register_framework,
    registered_frameworks,
)
from estimators.frameworks.lightning._config import LightningConfig
from estimators.frameworks.lightning._framework import LightningFramework
from estimators.frameworks.lightning._train import LightningSpec, train_lightning
from estimators.frameworks.torch._framework import TorchFramework
from estimators.frameworks.torch._loop import train
from estimators.frameworks.torch._spec import TorchSpec

ROOT = pathlib.Path(__file__).resolve().parents[2]
BUILT_IN = ("torch", "lightning", "keras")
# the Hugging Face plug-in shares the torch loop's params (so not in the disjointness test)
ALL_BUILT_IN = (*BUILT_IN, "huggingface")
# The interface: every public member of the base class (attributes and methods).
MEMBERS = sorted(name for name in vars(Framework) if not name.startswith("_"))
# The steps a framework must implement (the base raises NotImplementedError for them).
REQUIRED = (
    "worker",
    "checkpoint_epoch",
    "load_checkpoint",
    "predictor",
    "save_model",
    "load_model",
    "log_model",
)


def test_the_interface_has_every_step_a_framework_owns():
    assert set(MEMBERS) == {
        "name",
        "pickles_model",
        "typed_features",
        "params",
        "refusal",
        "instead",
        "check_params",
        "resolve",
        "check_resume",
        "check_first_batch",
        "check_prepared",
        "worker",
        "checkpoint_epoch",
        "load_checkpoint",
        "model_params",
        "reads_model_params",
        "predictor",
        "model_predictor",
        "check_save",
        "save_model",
        "load_model",
        "save_model_params",
        "load_model_params",
        "log_model",
    }


@pytest.mark.parametrize("name", ALL_BUILT_IN)
def test_every_built_in_framework_implements_the_whole_interface(name):
    framework = get_framework(name)
    assert isinstance(framework, Framework) and framework.name == name
    assert isinstance(framework.pickles_model, bool)
    assert set(framework.params) and framework.params is not Framework.params
    for member in MEMBERS:
        base = getattr(Framework, member)
        if not callable(base):
            continue
        method = getattr(type(framework), member)
        wanted = list(inspect.signature(base).parameters)
        assert list(inspect.signature(method).parameters) == wanted, f"{name}.{member}"
    for member in REQUIRED:
        assert getattr(type(framework), member) is not getattr(Framework, member), member


def test_the_built_in_frameworks_own_disjoint_params():
    owned = [set(get_framework(name).params) for name in BUILT_IN]
    assert all(a.isdisjoint(b) for i, a in enumerate(owned) for b in owned[i + 1 :])


def test_an_unknown_framework_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown framework 'jax'.*torch, lightning, keras"):
        get_framework("jax")


class _Scaled(torch.nn.Linear):
    """An nn.Module of a framework of its own (as a Hugging Face model would be)."""


class _ScaledFramework(TorchFramework):
    name = "scaled-torch"


def test_detection_asks_the_newest_registration_first_and_names_refuse_twice():
    register_framework(
        "scaled-torch",
        _ScaledFramework,
        detect=lambda model: isinstance(model, _Scaled),
        takes="a _Scaled",
        override=True,  # the test may run twice in one process
    )
    assert framework_of(_Scaled(2, 1)).name == "scaled-torch"
    assert framework_of(torch.nn.Linear(2, 1)).name == "torch"  # the older one still
    assert registered_frameworks()[:3] == list(BUILT_IN)
    with pytest.raises(ValueError, match=r"'torch' is registered already.*override=True"):
        register_framework("torch", TorchFramework, detect=lambda m: False, takes="x")
    with pytest.raises(ValueError, match=r"model must be a torch.nn.Module, a LightningModule"):
        framework_of("not a model")


def _values(**changed):
    from estimators import RingEstimator
    from estimators.fit._resolve import param_values

    return {**param_values(RingEstimator()), **changed}


@pytest.mark.parametrize(
    ("framework", "changed", "message"),
    [
        ("keras", {"precision": "bf16"}, r"precision='bf16' is set, but it configures "
         r"ringtrain's torch loop and the model is a keras model: a Keras model configures "
         r"this with Keras callbacks"),
        ("lightning", {"lr_scheduler_interval": "step"}, r"the model is a lightning model: a "
         r"LightningModule configures this on its Trainer"),
        ("torch", {"checkpoint_callback": "cb"}, r"configures a Keras model's fit and the model "
         r"is a torch model: a torch model keeps the best epoch by itself"),
        ("lightning", {"custom_objects": {"a": 1}}, r"is a lightning model\. Unset it "
         r"\(setParams\(custom_objects=\{\}\)\)"),
        ("keras", {"terminate_on_nan": True}, r"terminate_on_nan=True is set, but the model is "
         r"a keras model: terminate_on_nan configures the lightning.Trainer"),
    ],
)  # fmt: skip
def test_a_param_only_another_framework_reads_is_refused_with_its_owners_message(
    framework, changed, message
):
    model_framework = get_framework(framework)
    with pytest.raises(ValueError, match=message):
        refuse_foreign_params(_values(**changed), model_framework)
    refuse_foreign_params(_values(), model_framework)  # nothing set: nothing refused
    owner = next(n for n in BUILT_IN if set(changed) <= set(get_framework(n).params))
    refuse_foreign_params(_values(**changed), get_framework(owner))  # its own: read


# A comparison of a framework: by name (`== "keras"`, `!= TORCH`, `kind in ("torch", ...)`),
# by identity (`reader is not framework`), by type (`isinstance(f, KerasFramework)`), or a
# framework's own detector called instead of the registry (`if is_keras_model(model)`).
_NAMES = {"torch", "lightning", "keras", "TORCH", "LIGHTNING", "KERAS"}
_DETECTOR = re.compile(r"^is_(torch|lightning|keras)_")


def _stands_for_a_framework(node: ast.AST) -> bool:
    """A framework's name (a literal or a constant), or a value named after a framework."""
    if isinstance(node, ast.Constant):
        return node.value in _NAMES
    if isinstance(node, ast.Name):
        return node.id in _NAMES or "framework" in node.id.lower()
    if isinstance(node, ast.Attribute):
        named = node.attr == "name" and _stands_for_a_framework(node.value)
        return named or "framework" in node.attr.lower()
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(_stands_for_a_framework(e) for e in node.elts)
    return False


def _comparisons(source: str) -> list[int]:
    """The lines of ``source`` that compare frameworks (see above)."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare):
            if any(_stands_for_a_framework(o) for o in [node.left, *node.comparators]):
                lines.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute):
            name = ast.unparse(node.func).rsplit(".", 1)[-1]
            typed = name in ("isinstance", "issubclass") and len(node.args) == 2
            if (typed and "Framework" in ast.unparse(node.args[1])) or _DETECTOR.match(name):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize(
    "code",
    [
        'if kind == "keras": pass',
        "if reader is not framework and x: pass",
        "if cfg.framework is TORCH_FW: pass",
        'if cfg.framework.name != "lightning": pass',
        "ok = isinstance(fw, KerasFramework)",
        "if name in (TORCH, LIGHTNING): pass",
        "skip = [n for n in names if n == LIGHTNING]",
        "if not is_lightning_module(cfg.model): pass",
    ],
)
def test_the_comparison_check_sees_names_identities_and_types(code):
    assert _comparisons(code) == [1]


def test_the_comparison_check_passes_what_only_uses_a_framework():
    code = (
        "framework = framework_of(model)\n"
        "if param in framework.params or value is None: pass\n"
        "config = getattr(cfg, 'framework_config', None)\n"
        '"""a docstring saying its framework is torch"""\n'
    )
    assert _comparisons(code) == []


def test_no_module_outside_frameworks_compares_framework_names_or_identities():
    offenders = []
    for path in sorted((ROOT / "estimators").rglob("*.py")):
        rel = path.relative_to(ROOT / "estimators").as_posix()
        if not rel.startswith("frameworks/"):
            offenders += [f"{rel}:{n}" for n in _comparisons(path.read_text())]
    assert offenders == [], "dispatch through the framework the registry gives instead"


def test_the_torch_and_lightning_frameworks_import_neither_keras_nor_lightning():
    code = (
        "import sys, json, estimators\n"
        "from estimators.frameworks import get_framework\n"
        "get_framework('torch'), get_framework('lightning'), get_framework('keras')\n"
        "heavy = ('tensorflow', 'keras', 'lightning', 'pytorch_lightning')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_lightning_framework_is_a_torch_one_that_checks_and_trains_its_own_way():
    torch_fw, lightning_fw = get_framework("torch"), get_framework("lightning")
    assert isinstance(lightning_fw, TorchFramework) and isinstance(lightning_fw, LightningFramework)
    assert type(lightning_fw).check_params is not TorchFramework.check_params
    assert type(lightning_fw).resolve is not TorchFramework.resolve
    assert type(lightning_fw).load_checkpoint is TorchFramework.load_checkpoint
    assert torch_fw.pickles_model and lightning_fw.pickles_model
    assert not get_framework("keras").pickles_model


def _cfg(model: torch.nn.Module, store: object) -> SimpleNamespace:
    return SimpleNamespace(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        loss=torch.nn.MSELoss(),
        metrics=[],
        callbacks=[],
        feature_cols=["x"],
        label_cols=["y"],
        batch_size=4,
        val_batch_size=4,
        epochs=1,
        validation_steps_per_epoch=None,
        shuffle=True,
        seed=1,
        reader="arrow",
        reader_workers=1,
        val_reader_workers=1,
        reader_pool="thread",
        backward_passes_per_step=1,
        store=store,
        run_id="r",
        sample_weight_col=None,
        transformation_fn=None,
        use_gpu=False,
        inmemory_cache_all=False,
    )


def test_the_torch_worker_is_the_torch_loop(tmp_path):
    data = SimpleNamespace(train_path="t", val_path=None, steps_per_epoch=3)
    fn, (spec,) = get_framework("torch").worker(_cfg(torch.nn.Linear(2, 1), str(tmp_path)), data)
    assert fn is train and type(spec) is TorchSpec
    assert spec.steps_per_epoch == 3 and spec.optimizer_groups == [[0, 1]]


def test_the_lightning_worker_fits_under_a_trainer_with_the_lightning_params(tmp_path):
    """A LightningModule's worker is ``train_lightning`` (a real lightning.Trainer), its
    spec the data half plus the Trainer's params from the fit's ``LightningConfig``."""
    data = SimpleNamespace(train_path="t", val_path=None, steps_per_epoch=3)
    cfg = _cfg(torch.nn.Linear(2, 1), str(tmp_path))
    fn, (spec,) = get_framework("lightning").worker(cfg, data)
    assert fn is train_lightning and type(spec) is LightningSpec
    assert spec.steps_per_epoch == 3
    assert (spec.trainer_args, spec.logger, spec.log_every_n_steps) == ({}, None, 50)
    assert (spec.terminate_on_nan, spec.profiler) == (False, None)
    params = {
        "trainer_args": {"precision": "bf16-mixed"},
        "logger": "a logger",
        "log_every_n_steps": 5,
        "terminate_on_nan": True,
        "profiler": "simple",
    }
    config = LightningConfig(**params)
    cfg = SimpleNamespace(**vars(cfg), framework_config=config)
    _, (spec,) = get_framework("lightning").worker(cfg, data)
    assert {name: getattr(spec, name) for name in params} == params
    assert spec.trainer_args is not config.trainer_args  # the spec holds its own copy


def test_the_torch_framework_saves_loads_and_predicts_a_module(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model.register_buffer("scale", torch.tensor(2.0), persistent=False)
    framework = framework_of(model)
    framework.save_model(model, str(tmp_path / "saved"))
    loaded = framework.load_model(str(tmp_path / "saved"))
    assert torch.equal(loaded[0].weight, model[0].weight) and loaded.scale == 2.0
    kinds, predict = framework.predictor(loaded, [[3]], ["x"], 1, ["y__output"], False)
    assert [k.simpleString() for k in kinds] == ["array<double>"]
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    batch = pa.RecordBatch.from_arrays(
        [pa.array(list(rows), type=pa.list_(pa.float32()))], names=["x"]
    )
    (out,) = list(predict([batch]))
    assert out.schema.names == ["x", "y__output"]
    with torch.no_grad():
        expected = model(torch.from_numpy(rows)).double().numpy()
    np.testing.assert_allclose(np.array(out.column(1).to_pylist()), expected, rtol=1e-6)


def test_the_torch_framework_refuses_an_optimizer_of_another_model():
    model, other = torch.nn.Linear(2, 1), torch.nn.Linear(2, 1)
    with pytest.raises(ValueError, match=r"optimizer holds 2 parameter\(s\) that are not"):
        get_framework("torch").check_params(
            model, torch.optim.SGD(other.parameters(), lr=0.1), torch.nn.MSELoss(), []
        )
