"""FSDP2's knobs as one frozen, picklable value (what crosses to the workers)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

_DTYPES = ("float32", "float16", "bfloat16")
_ALIASES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16"}


def _dtype_name(field: str, value: Any) -> str | None:
    if value is None:
        return None
    name = str(value).replace("torch.", "")
    name = _ALIASES.get(name, name)
    if name not in _DTYPES:
        raise ValueError(
            f"fsdp_config {field}={value!r} is not a floating dtype FSDP can cast to; use "
            f"one of {', '.join(_DTYPES)} (or bf16/fp16), or None"
        )
    return name


@dataclass(frozen=True)
class FsdpConfig:
    """``fully_shard``'s settings.

    - ``param_dtype`` / ``reduce_dtype``: ``MixedPrecisionPolicy`` (e.g. ``"bf16"``:
      compute in bfloat16, reduce gradients in it too unless ``reduce_dtype`` says
      otherwise); None keeps float32.
    - ``reshard_after_forward``: free the gathered parameters after each unit's forward
      (less memory, one more all-gather in backward); False keeps them until backward.
    - ``cpu_offload``: keep the sharded parameters, gradients and optimizer state in host
      memory (``CPUOffloadPolicy``; on a CPU-only job this changes nothing).
    - ``shard_modules``: the names of the module classes that are units of their own
      (e.g. ``("BertLayer",)``); None: every module inside an ``nn.ModuleList``.
    """

    param_dtype: str | None = None
    reduce_dtype: str | None = None
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    shard_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", _dtype_name("param_dtype", self.param_dtype))
        object.__setattr__(self, "reduce_dtype", _dtype_name("reduce_dtype", self.reduce_dtype))
        for name in ("reshard_after_forward", "cpu_offload"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"fsdp_config {name}={getattr(self, name)!r} must be True or False"
                )
        modules = self.shard_modules
        if modules is not None:
            if isinstance(modules, str):
                modules = (modules,)
            modules = tuple(modules)
            if not modules or not all(isinstance(m, str) and m for m in modules):
                raise ValueError(
                    f"fsdp_config shard_modules={self.shard_modules!r} must name module "
                    "classes, e.g. ('BertLayer',), or be None for every module of a ModuleList"
                )
            object.__setattr__(self, "shard_modules", modules)

    @classmethod
    def of(cls, value: Any) -> FsdpConfig:
        """``value`` as a config: None (the defaults), a dict of the fields, or a config."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in dataclasses.fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ValueError(
                    f"fsdp_config has unknown key(s) {', '.join(map(repr, unknown))}; the "
                    f"keys are {', '.join(sorted(known))}"
                )
            return cls(**value)
        raise ValueError(
            f"fsdp_config={value!r} must be None, a dict or an FsdpConfig, "
            f"got {type(value).__name__}"
        )

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
