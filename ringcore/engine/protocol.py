"""The control protocol between every rank's engine and rank 0's coordinator.

A rank sends a :class:`Request` per op it submits (or, once the coordinator has
cached it, a :class:`CachedRequest`: the cache id and what changes per call, or a
:class:`CachedId`, the bare id, when nothing changed); the coordinator answers every
rank with the same ordered list of :class:`ResponseItem`, whose entries are bare ids
too once every rank has seen them in full (:attr:`Entry.compact`). The control
messages that carry them are in ``messages``; the fusion rule in ``fusion``.

The values are typed (an op's kind is an :class:`~ringcore._ops.OpKind`); the
one-letter keys of the JSON frames (``wire``) exist only at the edge, in
``to_wire()`` / ``from_wire()``. :data:`AGREE_FIELDS` is the one place that says which
request fields every rank must submit alike, under which label a mismatch is reported,
and what a cache id stands for.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from operator import attrgetter
from typing import Any

from .._ops import OpKind

__all__ = [
    "AGREE_FIELDS",
    "DEFAULT_ROOT",
    "AgreeField",
    "CachedId",
    "CachedRequest",
    "Entry",
    "Request",
    "ResponseItem",
    "decode_request",
    "disagreement",
]

# The root of an op that has none (every op but broadcast): one value for every builder.
DEFAULT_ROOT = -1
#: an op kind by its value on the wire (a plain dict: faster than ``OpKind(value)``)
KINDS = {k.value: k for k in OpKind}
_ALLREDUCE, _ALLGATHER, _ALLTOALL = OpKind.ALLREDUCE, OpKind.ALLGATHER, OpKind.ALLTOALL
_JOIN, _ERROR = OpKind.JOIN, OpKind.ERROR
_PS_ADD, _PS_REMOVE, _REDUCESCATTER = OpKind.PS_ADD, OpKind.PS_REMOVE, OpKind.REDUCESCATTER


@dataclass(frozen=True)
class AgreeField:
    """A request field every rank must submit alike: its attribute, wire key and the
    label a mismatch message names it by."""

    attr: str
    key: str
    label: str


AGREE_FIELDS: tuple[AgreeField, ...] = (
    AgreeField("kind", "k", "op kind"),
    AgreeField("dtype", "d", "dtype"),
    AgreeField("op", "o", "reduce op"),
    AgreeField("root", "r", "root rank"),
    AgreeField("prescale", "pre", "prescale_factor"),
    AgreeField("postscale", "post", "postscale_factor"),
    AgreeField("device", "dev", "device"),
    AgreeField("group", "g", "group"),
    AgreeField("group_size", "gn", "group size"),
    AgreeField("ranks", "ranks", "process set ranks"),
    AgreeField("set_id", "id", "process set"),
)


_SIGNATURE = attrgetter(*(f.attr for f in AGREE_FIELDS))


def _listed(value: Any) -> Any:
    """A field's value as a mismatch message shows it (a kind by its value)."""
    if isinstance(value, Enum):
        return value.value
    return list(value) if isinstance(value, tuple) else value


def _tupled(value: Any) -> Any:
    return None if value is None else tuple(value)


def _build(cls: type, fields: dict[str, Any]) -> Any:
    """A frozen value of ``cls`` holding ``fields`` (every field, already decoded),
    without ``__init__``'s one ``object.__setattr__`` per field: negotiation decodes
    thousands of requests and entries per step, and this is several times faster."""
    obj: Any = object.__new__(cls)
    obj.__dict__.update(fields)
    return obj


@dataclass(frozen=True)
class Request:
    """One op as a rank submits it. ``shape`` and ``splits`` may differ per call and
    per rank (within the op's rules); the :data:`AGREE_FIELDS` may not."""

    name: str
    kind: OpKind
    dtype: str = ""
    shape: tuple[int, ...] = ()
    process_set: int = 0
    op: int = 0
    root: int = DEFAULT_ROOT
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = ""
    group: str | None = None  # grouped allreduce: the group's id ...
    group_size: int | None = None  # ... and its number of tensors
    splits: tuple[int, ...] | None = None  # alltoall: rows sent to each member
    ranks: tuple[int, ...] | None = None  # ps_add: the new set's ranks
    set_id: int | None = None  # ps_remove: the set's id

    def signature(self) -> tuple:
        """What a cache id stands for: the values of :data:`AGREE_FIELDS` (read in one
        C call), kept on the request: the bindings reuse one request per name, and a new
        tuple per op would be one more object for the garbage collector to track. Only
        non-agree fields differ between a request and what ``expand`` makes of it, so a
        copied ``_sig`` stays true."""
        sig = self.__dict__.get("_sig")
        if sig is None:
            sig = self.__dict__["_sig"] = _SIGNATURE(self)
        return sig

    def cached(self, cache_id: int) -> CachedRequest:
        """This request as sent once the coordinator knows it under ``cache_id``."""
        return CachedRequest(cache_id, self.name, self.shape, self.process_set, self.splits)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "n": self.name,
            "k": self.kind,
            "d": self.dtype,
            "s": list(self.shape),
            "ps": self.process_set,
            "o": self.op,
            "r": self.root,
            "pre": self.prescale,
            "post": self.postscale,
            "dev": self.device,
        }
        if self.group is not None:
            wire["g"], wire["gn"] = self.group, self.group_size
        if self.splits is not None:
            wire["sp"] = list(self.splits)
        if self.ranks is not None:
            wire["ranks"] = list(self.ranks)
        if self.set_id is not None:
            wire["id"] = self.set_id
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> Request:
        return _build(
            cls,
            {
                "name": wire["n"],
                "kind": KINDS[wire["k"]],
                "dtype": wire.get("d", ""),
                "shape": tuple(wire.get("s", ())),
                "process_set": wire.get("ps", 0),
                "op": wire.get("o", 0),
                "root": wire.get("r", DEFAULT_ROOT),
                "prescale": wire.get("pre", 1.0),
                "postscale": wire.get("post", 1.0),
                "device": wire.get("dev", ""),
                "group": wire.get("g"),
                "group_size": wire.get("gn"),
                "splits": _tupled(wire.get("sp")),
                "ranks": _tupled(wire.get("ranks")),
                "set_id": wire.get("id"),
            },
        )


@dataclass(frozen=True)
class CachedRequest:
    """A request the coordinator has cached: its id plus the fields a call may change."""

    cache_id: int
    name: str
    shape: tuple[int, ...]
    process_set: int = 0
    splits: tuple[int, ...] | None = None

    def expand(self, template: Request) -> Request:
        """The full request: the cached ``template`` with this call's name, shape, splits."""
        fields = dict(template.__dict__)
        fields.update(
            name=self.name, shape=self.shape, process_set=self.process_set, splits=self.splits
        )
        return _build(Request, fields)

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {
            "c": self.cache_id,
            "n": self.name,
            "s": list(self.shape),
            "ps": self.process_set,
        }
        if self.splits is not None:
            wire["sp"] = list(self.splits)
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> CachedRequest:
        return _build(
            cls,
            {
                "cache_id": wire["c"],
                "name": wire["n"],
                "shape": tuple(wire.get("s", ())),
                "process_set": wire.get("ps", 0),
                "splits": _tupled(wire.get("sp")),
            },
        )


@dataclass(frozen=True)
class CachedId:
    """A cached request sent as its bare id: the same name, process set and shape as the
    coordinator's template, no splits. On the wire: the integer alone."""

    cache_id: int

    def to_wire(self) -> int:
        return self.cache_id


def decode_request(wire: dict[str, Any] | int) -> Request | CachedRequest | CachedId:
    if type(wire) is int:
        return _build(CachedId, {"cache_id": wire})
    if not isinstance(wire, dict):
        raise ValueError(f"a request must be an object or a cache id, got {type(wire).__name__}")
    return CachedRequest.from_wire(wire) if "c" in wire else Request.from_wire(wire)


@dataclass(frozen=True)
class Entry:
    """One named op of a response item (a fused allreduce has several).

    ``compact``: sent as the bare ``cache_id`` (the op's name and shape are the ones
    every member rank learnt from the entry that first carried the id); an entry read
    from that form has no name or shape until the engine fills them in."""

    name: str
    shape: tuple[int, ...] = ()
    cache_id: int | None = None
    compact: bool = False

    def to_wire(self) -> dict[str, Any] | int:
        if self.compact and self.cache_id is not None:
            return self.cache_id
        return {"n": self.name, "s": list(self.shape), "c": self.cache_id}


def _entry(wire: dict[str, Any] | int) -> Entry:
    if type(wire) is int:
        return _build(Entry, {"name": "", "shape": (), "cache_id": wire, "compact": True})
    if not isinstance(wire, dict):
        raise ValueError(f"an entry must be an object or a cache id, got {type(wire).__name__}")
    return _build(
        Entry,
        {
            "name": wire["n"],
            "shape": tuple(wire.get("s", ())),
            "cache_id": wire.get("c"),
            "compact": False,
        },
    )


@dataclass(frozen=True)
class ResponseItem:
    """One thing every rank runs, in the coordinator's order: an op on ``entries``, a
    process-set change, the end of a join, or an error for ``entries``."""

    kind: OpKind
    process_set: int = 0
    dtype: str = ""
    entries: tuple[Entry, ...] = ()
    op: int = 0
    prescale: float = 1.0
    postscale: float = 1.0
    device: str = ""
    root: int = DEFAULT_ROOT
    dims: tuple[int, ...] = ()  # allgather: every member's first dimension
    splits: tuple[tuple[int, ...], ...] = ()  # alltoall: every member's send splits
    set_id: int = 0  # ps_add / ps_remove
    ranks: tuple[int, ...] = ()  # ps_add
    last: int = -1  # join: the last rank to join
    message: str = ""  # error
    error_kind: str = ""  # error: "mismatch", "stall" or "peer"

    def to_wire(self) -> dict[str, Any]:
        kind = self.kind
        if kind == _JOIN:
            return {"k": kind, "last": self.last}
        entries = [e.to_wire() for e in self.entries]
        if kind == _ERROR:
            return {
                "k": kind,
                "ps": self.process_set,
                "e": [{"n": e.name} for e in self.entries],
                "msg": self.message,
                "x": self.error_kind,
            }
        if kind == _ALLREDUCE:
            return {
                "k": kind,
                "ps": self.process_set,
                "d": self.dtype,
                "o": self.op,
                "pre": self.prescale,
                "post": self.postscale,
                "dev": self.device,  # a joined rank makes its zeros on this device type
                "e": entries,
            }
        wire: dict[str, Any] = {
            "k": kind,
            "ps": self.process_set,
            "d": self.dtype,
            "e": entries,
            "r": self.root,
        }
        if kind == _ALLGATHER:
            wire["dims"] = list(self.dims)
        elif kind == _ALLTOALL:
            wire["splits"] = [list(s) for s in self.splits]
        elif kind == _PS_ADD:
            wire["id"], wire["ranks"] = self.set_id, list(self.ranks)
        elif kind == _PS_REMOVE:
            wire["id"] = self.set_id
        elif kind == _REDUCESCATTER:
            wire.update(o=self.op, pre=self.prescale, post=self.postscale)
        return wire

    @classmethod
    def from_wire(cls, wire: dict[str, Any]) -> ResponseItem:
        root = wire.get("r")
        return _build(
            cls,
            {
                "kind": KINDS[wire["k"]],
                "process_set": wire.get("ps", 0),
                "dtype": wire.get("d", ""),
                "entries": tuple(_entry(e) for e in wire.get("e", ())),
                "op": wire.get("o", 0),
                "prescale": wire.get("pre", 1.0),
                "postscale": wire.get("post", 1.0),
                "device": wire.get("dev", ""),
                "root": DEFAULT_ROOT if root is None else root,
                "dims": tuple(wire.get("dims", ())),
                "splits": tuple(tuple(s) for s in wire.get("splits", ())),
                "set_id": wire.get("id", 0),
                "ranks": tuple(wire.get("ranks", ())),
                "last": wire.get("last", -1),
                "message": wire.get("msg", ""),
                "error_kind": wire.get("x", ""),
            },
        )


# -- agreement ---------------------------------------------------------------------

#: the kinds whose ranks may differ in the first dimension only / not at all
_ANY_FIRST_DIM = (OpKind.ALLGATHER, OpKind.ALLTOALL)
_SAME_SHAPE = (OpKind.ALLREDUCE, OpKind.BROADCAST, OpKind.REDUCESCATTER)


def disagreement(name: str, reqs: dict[int, Request]) -> str | None:
    """A message naming the field and each rank's value when the requests disagree."""
    ranks = sorted(reqs)
    kind = reqs[ranks[0]].kind
    for f in AGREE_FIELDS:
        values = {r: _listed(getattr(reqs[r], f.attr)) for r in ranks}
        if len(set(map(repr, values.values()))) > 1:
            detail = ", ".join(f"rank {r}: {v}" for r, v in values.items())
            return (
                f"{kind} of {name!r}: ranks disagree on {f.label} ({detail}). "
                f"Every rank must submit the same {f.label} for one name."
            )
    shapes = {r: reqs[r].shape for r in ranks}
    if kind in _ANY_FIRST_DIM:
        trailing = {r: (len(s), s[1:]) for r, s in shapes.items()}
        if len(set(trailing.values())) > 1:
            detail = ", ".join(f"rank {r}: {s}" for r, s in shapes.items())
            return (
                f"{kind} of {name!r}: ranks may differ only in the first dimension, but the "
                f"shapes are {detail}. Make every dimension after the first agree."
            )
    elif kind in _SAME_SHAPE and len(set(shapes.values())) > 1:
        detail = ", ".join(f"rank {r}: {s}" for r, s in shapes.items())
        return (
            f"{kind} of {name!r}: ranks disagree on shape ({detail}). "
            "Every rank must pass a tensor of the same shape."
        )
    return None
