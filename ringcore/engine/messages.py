"""The control messages between a rank's engine and the coordinator, around the requests
and responses of ``protocol``: :class:`RequestBatch`, :class:`JoinRequest`,
:class:`Goodbye` (both ways), :class:`ResponseBatch`, :class:`Abort` and
:class:`Heartbeat`. A frame is decoded into one of them (:func:`decode_message`) where
it is read; nothing above reads a frame's keys.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .protocol import CachedId, CachedRequest, Request, ResponseItem, _build, decode_request

__all__ = [
    "Abort",
    "Goodbye",
    "Heartbeat",
    "JoinRequest",
    "Message",
    "RequestBatch",
    "ResponseBatch",
    "decode_message",
]


@dataclass(frozen=True)
class RequestBatch:
    """rank -> coordinator: the requests queued since the last batch, in order.
    ``ranks``: one rank of a host sends them for every rank of its host, which agreed on
    them (the host relay, ``ringcore.engine.lane``); None: for the sender alone."""

    TAG = "req"
    requests: tuple[Request | CachedRequest | CachedId, ...]
    ranks: tuple[int, ...] | None = None

    def to_wire(self) -> dict[str, Any]:
        wire: dict[str, Any] = {"t": self.TAG, "reqs": [r.to_wire() for r in self.requests]}
        if self.ranks is not None:
            wire["for"] = list(self.ranks)
        return wire


@dataclass(frozen=True)
class JoinRequest:
    """rank -> coordinator: this rank is out of data (``join()``)."""

    TAG = "join"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.TAG}


@dataclass(frozen=True)
class Goodbye:
    """rank -> coordinator: this rank shuts down; coordinator -> rank: acknowledged."""

    TAG = "bye"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.TAG}


@dataclass(frozen=True)
class ResponseBatch:
    """coordinator -> every rank: items to run, in this order."""

    TAG = "resp"
    items: tuple[ResponseItem, ...]

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.TAG, "items": [i.to_wire() for i in self.items]}


@dataclass(frozen=True)
class Abort:
    """coordinator -> every rank: the ring is broken (a rank was lost), and why."""

    TAG = "abort"
    reason: str

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.TAG, "msg": self.reason}


@dataclass(frozen=True)
class Heartbeat:
    """coordinator -> every rank, after a while with nothing else to send: rank 0 is
    alive. A rank that hears nothing at all for ``RING_CONTROL_TIMEOUT_SECONDS`` knows
    that rank 0 hangs (a stopped process keeps its connections open)."""

    TAG = "hb"

    def to_wire(self) -> dict[str, Any]:
        return {"t": self.TAG}


Message = RequestBatch | JoinRequest | Goodbye | ResponseBatch | Abort | Heartbeat


def decode_message(wire: dict[str, Any]) -> Message | None:
    """The message a frame holds; None for a tag this protocol does not know. The two
    that come once per op or batch are built without ``__init__`` (``_build``)."""
    tag = wire.get("t")
    if tag == RequestBatch.TAG:
        ranks = wire.get("for")
        return _build(
            RequestBatch,
            {
                "requests": tuple(map(decode_request, wire["reqs"])),
                "ranks": None if ranks is None else tuple(ranks),
            },
        )
    if tag == ResponseBatch.TAG:
        return _build(ResponseBatch, {"items": tuple(map(ResponseItem.from_wire, wire["items"]))})
    if tag == JoinRequest.TAG:
        return JoinRequest()
    if tag == Goodbye.TAG:
        return Goodbye()
    if tag == Abort.TAG:
        return Abort(wire["msg"])
    if tag == Heartbeat.TAG:
        return Heartbeat()
    return None
