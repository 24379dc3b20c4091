"""The arithmetic of the shared-memory group: reduce operators, scaling, the op descriptor.

Operators are :class:`ringcore._ops.ReduceOp` members (``Sum``, ``Average``, ``Min``,
``Max``, ``Product``), their integer values, or their names as strings (``"sum"``,
``"average"``/``"avg"``, ...). Scaling and Average follow the engine (Horovod's C++
core): floating and complex tensors exactly, integers multiplied in float64 and
truncated. Bool tensors reduce logically (Sum and Max: or; Min and Product: and).
"""

from __future__ import annotations

import torch

from .._errors import CollectiveMismatchError
from .._ops import OpKind, ReduceOp

__all__ = [
    "DTYPES",
    "Descriptor",
    "finish_",
    "reduce_into_",
    "resolve",
    "write_scaled_",
]

DTYPES: tuple[torch.dtype, ...] = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int8,
    torch.uint8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.complex64,
    torch.complex128,
)
_ALIASES = {"avg": ReduceOp.Average, "mean": ReduceOp.Average, "prod": ReduceOp.Product}
_SUPPORTED = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


def resolve(op: ReduceOp | int | str, dtype: torch.dtype) -> ReduceOp:
    """``op`` as a :class:`ReduceOp`, checked against ``dtype``; ValueError naming the fix."""
    if isinstance(op, ReduceOp):
        rop = op
    elif isinstance(op, str):
        key = op.strip().lower()
        found = _ALIASES.get(key)  # Average is 0: test for None, not truth
        if found is None:
            found = next((m for m in ReduceOp if m.name.lower() == key), None)
        if found is None:
            raise ValueError(
                f"op={op!r} is not a reduce operator; use one of sum, average, min, max, product."
            )
        rop = found
    else:
        rop = ReduceOp(int(op))
    if rop not in _SUPPORTED:
        raise ValueError(
            f"the shared-memory group does not implement op={rop.name}; use the network path."
        )
    if dtype.is_complex and rop in (ReduceOp.Min, ReduceOp.Max):
        raise ValueError(
            f"op={rop.name} is undefined for complex tensors ({dtype}); use Sum or Average."
        )
    if dtype == torch.bool and rop == ReduceOp.Average:
        raise ValueError("op=Average is undefined for bool tensors; use Sum (or) or Min (and).")
    return rop


def dtype_code(dtype: torch.dtype) -> int:
    try:
        return DTYPES.index(dtype)
    except ValueError:
        names = ", ".join(str(d) for d in DTYPES)
        raise ValueError(
            f"the shared-memory group does not carry {dtype}; use one of {names}."
        ) from None


def _exact(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point or dtype.is_complex


def write_scaled_(dst: torch.Tensor, src: torch.Tensor, factor: float) -> None:
    """``dst = src * factor`` (one pass for floats; integers truncated as the engine does)."""
    if factor == 1.0 or dst.dtype == torch.bool:
        dst.copy_(src)
    elif _exact(dst.dtype):
        torch.mul(src, factor, out=dst)
    else:
        dst.copy_((src.to(torch.float64) * factor).trunc())


def reduce_into_(acc: torch.Tensor, other: torch.Tensor, op: ReduceOp) -> None:
    """``acc = acc op other`` in place."""
    if acc.dtype == torch.bool:
        if op in (ReduceOp.Sum, ReduceOp.Max):
            acc.logical_or_(other)
        else:
            acc.logical_and_(other)
    elif op in (ReduceOp.Sum, ReduceOp.Average):
        acc.add_(other)
    elif op == ReduceOp.Product:
        acc.mul_(other)
    elif op == ReduceOp.Min:
        torch.minimum(acc, other, out=acc)
    else:
        torch.maximum(acc, other, out=acc)


def finish_(acc: torch.Tensor, op: ReduceOp, n: int, postscale: float) -> None:
    """Average's division by ``n``, then ``postscale``, on a reduced tensor in place."""
    exact = _exact(acc.dtype)
    if op == ReduceOp.Average:
        if exact:
            acc.div_(n)
        else:
            acc.copy_(torch.div(acc, n, rounding_mode="trunc"))
    if postscale != 1.0 and acc.dtype != torch.bool:
        if exact:
            acc.mul_(postscale)
        else:
            acc.copy_((acc.to(torch.float64) * postscale).trunc())


# Descriptor words (what every local rank must agree on), then the dims, then splits.
KIND, OP, ROOT, DTYPE, NDIM, NUMEL, DIM0, REST, FULL = range(9)
DIMS_AT, MAX_DIMS, SPLITS_AT = 9, 8, 24
#: the kinds a round describes, by their code in the KIND word (0: none)
KINDS: tuple[OpKind | None, ...] = (
    None,
    OpKind.ALLREDUCE,
    OpKind.ALLGATHER,
    OpKind.BROADCAST,
    OpKind.REDUCESCATTER,
    OpKind.ALLTOALL,
    OpKind.BARRIER,
)
_CODE = {k: i for i, k in enumerate(KINDS) if k is not None}
_ANY_ROW_KINDS = (OpKind.ALLGATHER, OpKind.ALLTOALL)
# Which words must be equal, by kind: the rows of allgather and alltoall may differ.
_SAME_ROWS: tuple[int, ...] = (KIND, OP, ROOT, DTYPE, NDIM, FULL)
_ANY_ROWS: tuple[int, ...] = (KIND, DTYPE, NDIM, REST)


class Descriptor:
    """The words one rank writes to describe its op; ``check`` compares all ranks' words."""

    @staticmethod
    def words(kind: OpKind, t: torch.Tensor | None, op: int = 0, root: int = 0) -> list[int]:
        w = [0] * SPLITS_AT
        w[KIND], w[OP], w[ROOT] = _CODE[kind], op, root
        if t is not None:
            shape = tuple(t.shape)
            w[DTYPE], w[NDIM], w[NUMEL] = dtype_code(t.dtype), len(shape), t.numel()
            w[DIM0] = shape[0] if shape else 1
            w[REST], w[FULL] = hash(shape[1:]), hash(shape)
            dims = shape[:MAX_DIMS]
            w[DIMS_AT : DIMS_AT + len(dims)] = dims
        return w

    @staticmethod
    def check(all_words: list[list[int]]) -> None:
        """Raise :class:`CollectiveMismatchError` (on every rank alike) if the ranks disagree."""
        first = all_words[0]
        if all(w == first for w in all_words):
            return
        kinds = {w[KIND] for w in all_words}
        if len(kinds) == 1 and KINDS[all_words[0][KIND]] in _ANY_ROW_KINDS:
            fields = _ANY_ROWS
        else:
            fields = _SAME_ROWS
        if all(all(w[f] == all_words[0][f] for f in fields) for w in all_words):
            return
        what = "; ".join(f"local rank {r}: {_describe(w)}" for r, w in enumerate(all_words))
        raise CollectiveMismatchError(
            f"the local ranks disagree on a collective ({what}). Make every rank call the "
            "same collective, in the same order, with tensors of the same dtype and shape "
            "(allgather/alltoall: the same shape after the first dimension)."
        )


def _describe(w: list[int]) -> str:
    kind = KINDS[w[KIND]] if 0 < w[KIND] < len(KINDS) else None
    if kind is None:
        return f"kind {w[KIND]}"
    if kind == OpKind.BARRIER:
        return str(kind)
    dims = w[DIMS_AT : DIMS_AT + min(w[NDIM], MAX_DIMS)]
    shape = str(tuple(dims)) if w[NDIM] <= MAX_DIMS else f"({', '.join(map(str, dims))}, ...)"
    text = f"{kind} dtype={DTYPES[w[DTYPE]]} shape={shape}"
    if kind in (OpKind.ALLREDUCE, OpKind.REDUCESCATTER):
        text += f" op={ReduceOp(w[OP]).name}"
    if kind == OpKind.BROADCAST:
        text += f" root={w[ROOT]}"
    return text
