"""The estimator's and the model's signatures and typed accessors follow the params tables.

``estimators._params`` holds one table per class; the explicit keyword-only constructors
and the committed typed declarations (``estimators/_accessors.py``) spell it out for
``help()``, IDEs and mypy. These tests fail when either drifts from the table.
"""

from __future__ import annotations

import inspect
import pathlib

import pytest

from estimators import RingEstimator, RingModel
from estimators._accessor_types import render_accessors
from estimators._params import ESTIMATOR_PARAMS, HOROVOD_ONLY_PARAMS, MODEL_PARAMS, accessor_names

ROOT = pathlib.Path(__file__).resolve().parents[2]
CLASSES = [(RingEstimator, ESTIMATOR_PARAMS), (RingModel, MODEL_PARAMS)]


@pytest.mark.parametrize(("cls", "specs"), CLASSES, ids=["RingEstimator", "RingModel"])
def test_the_constructor_takes_every_param_of_the_table_by_keyword_with_its_default(cls, specs):
    params = list(inspect.signature(cls).parameters.values())
    named = [p for p in params if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert [p.name for p in named] == [s.name for s in specs]
    for param, spec in zip(named, specs, strict=True):
        assert param.kind is inspect.Parameter.KEYWORD_ONLY, param.name
        assert param.default == spec.default, param.name
        assert param.annotation == spec.accepts, param.name


def test_only_the_estimator_takes_horovods_params_as_extra_keywords():
    (extra,) = [
        p
        for p in inspect.signature(RingEstimator).parameters.values()
        if p.kind is inspect.Parameter.VAR_KEYWORD
    ]
    assert extra.name == "horovod_params"
    model_kinds = {p.kind for p in inspect.signature(RingModel).parameters.values()}
    assert inspect.Parameter.VAR_KEYWORD not in model_kinds
    with pytest.raises(TypeError):
        RingModel(epoch_count=3)


@pytest.mark.parametrize(("cls", "specs"), CLASSES, ids=["RingEstimator", "RingModel"])
def test_a_param_not_passed_keeps_its_default_and_stays_unset(cls, specs):
    instance = cls(run_id="r")
    assert instance.isSet("run_id") and instance.getRunId() == "r"
    for spec in specs:
        if spec.name != "run_id":
            assert not instance.isSet(spec.name), spec.name
    assert not hasattr(instance, "_input_kwargs")  # no reference to the keywords is kept


def test_the_constructor_still_refuses_positional_arguments():
    with pytest.raises(TypeError):
        RingEstimator(object())


def test_the_committed_typed_accessors_are_what_the_tables_give():
    committed = (ROOT / "estimators" / "_accessors.py").read_text()
    assert committed == render_accessors(), (
        "estimators/_accessors.py is stale; regenerate it with "
        'python -c "from estimators._accessor_types import write_accessors; write_accessors()"'
    )


@pytest.mark.parametrize(("cls", "specs"), CLASSES, ids=["RingEstimator", "RingModel"])
def test_every_typed_accessor_is_a_generated_method_of_the_class(cls, specs):
    text = render_accessors()
    for spec in specs:
        for name in accessor_names(spec):
            assert f"def {name}(self" in text, name
            assert callable(getattr(cls, name)), name
    if cls is RingEstimator:
        for param in HOROVOD_ONLY_PARAMS:
            name = "set" + "".join(p[:1].upper() + p[1:] for p in param.name.split("_"))
            assert f"def {name}(self, value: Any)" in text and callable(getattr(cls, name))


def test_no_class_hides_its_accessors_behind_getattr():
    for cls, _ in CLASSES:
        assert all("__getattr__" not in vars(base) for base in cls.__mro__ if base is not object)
