"""The framework registry: one module per framework, reached by name, never by branching.

``estimators._frameworks.get_framework(name)`` gives the object that checks, trains,
loads, predicts with and saves models of that framework. These tests pin the seam:
every registered framework implements the whole interface, no other module compares
framework names, a torch fit imports neither Keras nor Lightning, and the torch
framework's save / load and predictor round-trip a model.
"""

from __future__ import annotations

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

from estimators._framework_torch import TorchFramework
from estimators._frameworks import (
    FRAMEWORKS,
    LIGHTNING,
    TORCH,
    Framework,
    framework_of,
    get_framework,
)
from estimators._train_lightning import LightningTrainSpec, train_lightning
from estimators._train_torch import TrainSpec, train

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The interface: every public member of the Protocol (properties and methods).
MEMBERS = sorted(
    name
    for name, value in vars(Framework).items()
    if not name.startswith("_") and (callable(value) or isinstance(value, property))
)


def test_the_interface_has_every_step_a_framework_owns():
    assert set(MEMBERS) == {
        "name",
        "pickles_model",
        "check_params",
        "check_first_batch",
        "check_prepared",
        "worker",
        "load_checkpoint",
        "predictor",
        "save_model",
        "load_model",
    }


@pytest.mark.parametrize("name", FRAMEWORKS)
def test_every_registered_framework_implements_the_whole_interface(name):
    framework = get_framework(name)
    assert isinstance(framework, Framework)
    assert framework.name == name
    assert isinstance(framework.pickles_model, bool)
    for member in MEMBERS:
        protocol = getattr(Framework, member)
        if isinstance(protocol, property):
            continue
        method = getattr(framework, member)
        assert callable(method), f"{name}.{member}"
        wanted = list(inspect.signature(protocol).parameters)[1:]  # without self
        assert list(inspect.signature(method).parameters) == wanted, f"{name}.{member}"


def test_an_unknown_framework_name_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown framework 'jax'.*torch, lightning, keras"):
        get_framework("jax")


# A comparison of a framework name: `== KERAS`, `!= "torch"`, `kind in (TORCH, ...)`.
_NAMES = r"(KERAS|LIGHTNING|TORCH|['\"](keras|torch|lightning)['\"])"
_COMPARISON = re.compile(rf"(==|!=)\s*{_NAMES}|{_NAMES}\s*(==|!=)|\bin\s*\(\s*{_NAMES}")


def test_no_module_outside_the_registry_compares_framework_names():
    registry = {"_frameworks.py"} | {p.name for p in (ROOT / "estimators").glob("_framework_*.py")}
    offenders = []
    for path in sorted((ROOT / "estimators").glob("*.py")):
        if path.name in registry:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if _COMPARISON.search(line):
                offenders.append(f"{path.name}:{number}: {line.strip()}")
    assert offenders == [], "dispatch through _frameworks.get_framework instead"


def test_the_torch_and_lightning_frameworks_import_neither_keras_nor_lightning():
    code = (
        "import sys, json, estimators\n"
        "from estimators._frameworks import get_framework\n"
        "get_framework('torch'), get_framework('lightning'), get_framework('keras')\n"
        "heavy = ('tensorflow', 'keras', 'lightning', 'pytorch_lightning')\n"
        "print(json.dumps(sorted(m for m in heavy if m in sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_a_lightning_framework_is_a_torch_one_that_checks_and_trains_its_own_way():
    torch_fw, lightning_fw = get_framework(TORCH), get_framework(LIGHTNING)
    assert isinstance(lightning_fw, TorchFramework)
    assert type(lightning_fw).check_params is not TorchFramework.check_params
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
    fn, (spec,) = get_framework(TORCH).worker(_cfg(torch.nn.Linear(2, 1), str(tmp_path)), data)
    assert fn is train and type(spec) is TrainSpec
    assert spec.lightning is False and spec.steps_per_epoch == 3
    assert spec.optimizer_groups == [[0, 1]]


def test_the_lightning_worker_fits_under_a_trainer_with_the_lightning_params(tmp_path):
    """A LightningModule's worker is ``train_lightning`` (a real lightning.Trainer), its
    spec the torch one plus the Trainer's knobs from the fit's config."""
    data = SimpleNamespace(train_path="t", val_path=None, steps_per_epoch=3)
    cfg = _cfg(torch.nn.Linear(2, 1), str(tmp_path))
    fn, (spec,) = get_framework(LIGHTNING).worker(cfg, data)
    assert fn is train_lightning and isinstance(spec, LightningTrainSpec)
    assert spec.lightning is True and spec.steps_per_epoch == 3
    assert (spec.trainer_args, spec.logger, spec.log_every_n_steps) == ({}, None, 50)
    assert (spec.terminate_on_nan, spec.profiler) == (False, None)
    knobs = {
        "trainer_args": {"precision": "bf16-mixed"},
        "logger": "a logger",
        "log_every_n_steps": 5,
        "terminate_on_nan": True,
        "profiler": "simple",
    }
    cfg = SimpleNamespace(**vars(cfg), **knobs)
    _, (spec,) = get_framework(LIGHTNING).worker(cfg, data)
    assert {name: getattr(spec, name) for name in knobs} == knobs
    assert spec.trainer_args is not cfg.trainer_args  # the spec holds its own copy


def test_the_torch_framework_saves_loads_and_predicts_a_module(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    model.register_buffer("scale", torch.tensor(2.0), persistent=False)
    framework = get_framework(framework_of(model))
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
        get_framework(TORCH).check_params(
            model, torch.optim.SGD(other.parameters(), lr=0.1), torch.nn.MSELoss(), []
        )
