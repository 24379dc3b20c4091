"""The text of ``_accessors.py``: typed declarations of the accessors ``_params`` generates.

``with_params`` adds ``getX`` / ``setX`` to a class at run time, which type checkers and
IDEs cannot see. :func:`render_accessors` writes, from the same tables, a mixin per class
whose ``if TYPE_CHECKING:`` body declares every ``Param`` attribute and accessor with
the types of :attr:`~estimators._params.ParamSpec.holds` / ``accepts``; the result is
committed as ``_accessors.py`` and tests/estimators/test_estimator_signature.py checks it is current.
"""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

from ._params import (
    ESTIMATOR_PARAMS,
    HOROVOD_ONLY_PARAMS,
    MODEL_PARAMS,
    HorovodParam,
    ParamSpec,
    _camel,
    accessor_names,
)

__all__ = ["render_accessors", "write_accessors"]


_ACCESSORS_HEADER = '''"""Typed declarations of the generated params and accessors, for type checkers and IDEs.

Generated from the tables of ``_params.py`` by ``_accessor_types.py``; do not
edit. Regenerate with::

    python -c "from estimators._accessor_types import write_accessors; write_accessors()"

tests/estimators/test_estimator_signature.py fails when this file is not what the tables give. At
run time the classes are empty: ``with_params`` / ``with_horovod_params`` add the
methods and ``Param`` attributes to the estimator and the model.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pyspark.ml.param import Param
    from typing_extensions import Self

    from .store._store import Store

__all__ = ["EstimatorAccessors", "ModelAccessors"]
'''


def _declarations(specs: Sequence[ParamSpec], horovod: Sequence[HorovodParam]) -> list[str]:
    lines = [f"        {spec.name}: Param[Any]" for spec in specs] + [""]
    for spec in specs:
        get_name, set_name = accessor_names(spec)
        lines.append(f"        def {get_name}(self) -> {spec.holds}: ...")
        lines.append(f"        def {set_name}(self, value: {spec.accepts}) -> Self: ...")
    for param in horovod:
        lines.append(f"        def set{_camel(param.name)}(self, value: Any) -> Self: ...")
    return lines


def _mixin(name: str, doc: str, lines: list[str]) -> str:
    body = "\n".join(lines)
    return f'\n\nclass {name}:\n    """{doc}"""\n\n    if TYPE_CHECKING:\n{body}\n'


def render_accessors() -> str:
    """The text of ``_accessors.py``: typed ``Param`` attributes, getters and setters of
    :data:`ESTIMATOR_PARAMS` (with Horovod's setters) and of :data:`MODEL_PARAMS`."""
    return (
        _ACCESSORS_HEADER
        + _mixin(
            "EstimatorAccessors",
            "The generated params and accessors of ``RingEstimator``.",
            _declarations(ESTIMATOR_PARAMS, HOROVOD_ONLY_PARAMS),
        )
        + _mixin(
            "ModelAccessors",
            "The generated params and accessors of ``RingModel``.",
            _declarations(MODEL_PARAMS, ()),
        )
    )


def write_accessors() -> None:
    """Write :func:`render_accessors` to ``_accessors.py`` beside this module."""
    (pathlib.Path(__file__).parent / "_accessors.py").write_text(render_accessors())
