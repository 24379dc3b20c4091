"""The control protocol: typed messages, their JSON wire form, and the agreement rules."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
import torch

from ringcore.engine.messages import (
    Abort,
    Goodbye,
    JoinRequest,
    RequestBatch,
    ResponseBatch,
    decode_message,
)
from ringcore.engine.protocol import (
    AGREE_FIELDS,
    DEFAULT_ROOT,
    CachedId,
    CachedRequest,
    Entry,
    Request,
    ResponseItem,
    decode_request,
    disagreement,
)
from ringcore.engine.reduction import average_


def _through_json(wire: dict) -> dict:
    return json.loads(json.dumps(wire, separators=(",", ":")))


REQUESTS = [
    Request("w", "allreduce", "float32", (3, 4), op=1, prescale=0.5, postscale=2.0, device="cpu"),
    Request("g.0", "allreduce", "float16", (2,), group="g#group", group_size=3, device="cuda"),
    Request("b", "broadcast", "int64", (5,), process_set=2, root=1, device="cpu"),
    Request("a", "alltoall", "float64", (6, 2), splits=(4, 2), device="cpu"),
    Request("ps_add.noname.0", "ps_add", ranks=(0, 2)),
    Request("ps_remove.noname.0", "ps_remove", set_id=3),
    Request("barrier.noname.0", "barrier", process_set=1),
]


@pytest.mark.parametrize("req", REQUESTS, ids=lambda r: r.kind)
def test_a_request_survives_its_json_round_trip(req):
    assert Request.from_wire(_through_json(req.to_wire())) == req
    assert decode_request(_through_json(req.to_wire())) == req


def test_a_request_keeps_the_short_keys_and_their_order_on_the_wire():
    wire = REQUESTS[1].to_wire()
    assert list(wire) == ["n", "k", "d", "s", "ps", "o", "r", "pre", "post", "dev", "g", "gn"]
    assert json.dumps(Request("x", "allgather", "int8", (2,), device="cpu").to_wire()) == (
        '{"n": "x", "k": "allgather", "d": "int8", "s": [2], "ps": 0, "o": 0, "r": -1, '
        '"pre": 1.0, "post": 1.0, "dev": "cpu"}'
    )


def test_a_cached_request_expands_to_the_template_with_this_calls_shape():
    template = REQUESTS[3]
    short = dataclasses.replace(template, shape=(8, 2), splits=(8, 0)).cached(7)
    wire = _through_json(short.to_wire())
    assert wire == {"c": 7, "n": "a", "s": [8, 2], "ps": 0, "sp": [8, 0]}
    decoded = decode_request(wire)
    assert isinstance(decoded, CachedRequest)
    full = decoded.expand(template)
    assert full.shape == (8, 2) and full.splits == (8, 0)
    assert full.signature() == template.signature()


def test_the_signature_is_the_agree_fields():
    req = REQUESTS[0]
    assert req.signature() == tuple(getattr(req, f.attr) for f in AGREE_FIELDS)
    keys = {f.key for f in AGREE_FIELDS}
    assert keys <= set(req.to_wire()) | {"g", "gn", "ranks", "id"}


ITEMS = [
    ResponseItem(
        "allreduce",
        0,
        "float32",
        (Entry("a", (2,), 0), Entry("b", (3, 1), None)),
        op=1,
        prescale=0.5,
        device="cpu",
    ),
    ResponseItem("allgather", 1, "int64", (Entry("g", (2, 3), 4),), dims=(2, 5)),
    ResponseItem("broadcast", 0, "float64", (Entry("b", (4,), 1),), root=1),
    ResponseItem("alltoall", 0, "float32", (Entry("t", (6,), 2),), splits=((4, 2), (1, 5))),
    ResponseItem("reducescatter", 0, "float32", (Entry("r", (4,), 3),), op=0, postscale=3.0),
    ResponseItem("ps_add", 0, "", (Entry("ps_add.noname.0", (), 5),), set_id=2, ranks=(0, 1)),
    ResponseItem("ps_remove", 0, "", (Entry("ps_remove.noname.0", (), None),), set_id=2),
    ResponseItem("barrier", 1, "", (Entry("barrier.noname.0", (), 6),)),
    ResponseItem("join", last=3),
    ResponseItem("error", 1, entries=(Entry("x"),), message="bad", error_kind="stall"),
]


@pytest.mark.parametrize("item", ITEMS, ids=lambda i: i.kind)
def test_a_response_item_survives_its_json_round_trip(item):
    assert ResponseItem.from_wire(_through_json(item.to_wire())) == item


def test_a_response_item_has_the_wire_form_of_its_kind():
    assert list(ITEMS[0].to_wire()) == ["k", "ps", "d", "o", "pre", "post", "dev", "e"]
    assert ITEMS[0].to_wire()["e"][1] == {"n": "b", "s": [3, 1], "c": None}
    assert list(ITEMS[5].to_wire()) == ["k", "ps", "d", "e", "r", "id", "ranks"]
    assert ITEMS[8].to_wire() == {"k": "join", "last": 3}
    assert ITEMS[9].to_wire() == {
        "k": "error",
        "ps": 1,
        "e": [{"n": "x"}],
        "msg": "bad",
        "x": "stall",
    }


@pytest.mark.parametrize(
    "message",
    [
        RequestBatch((REQUESTS[0], REQUESTS[3].cached(1))),
        JoinRequest(),
        Goodbye(),
        ResponseBatch(tuple(ITEMS)),
        Abort("rank 1 lost its control connection"),
    ],
    ids=lambda m: type(m).__name__,
)
def test_a_control_message_survives_its_json_round_trip(message):
    assert decode_message(_through_json(message.to_wire())) == message


def test_an_unknown_message_tag_decodes_to_none():
    assert decode_message({"t": "hello", "rank": 1}) is None


def test_a_bare_cache_id_is_an_integer_on_the_wire_both_ways():
    batch = RequestBatch((CachedId(7), REQUESTS[0].cached(2), REQUESTS[0]))
    wire = _through_json(batch.to_wire())
    assert wire["reqs"][0] == 7
    assert decode_message(wire) == batch
    item = ResponseItem("allreduce", 0, "float32", (Entry("a", (2,), 7, compact=True),))
    assert item.to_wire()["e"] == [7]
    # read back, a bare entry has no name or shape: the engine fills them in
    assert ResponseItem.from_wire(_through_json(item.to_wire())).entries == (
        Entry("", (), 7, compact=True),
    )


@pytest.mark.parametrize("junk", ["x", 1.5, None, [1]])
def test_a_request_that_is_neither_an_object_nor_a_cache_id_is_refused(junk):
    with pytest.raises(ValueError, match="object or a cache id"):
        decode_request(junk)


# -- agreement ------------------------------------------------------------------------

_DIFFERENT: dict[str, Any] = {
    "kind": "broadcast",
    "dtype": "float64",
    "op": 3,
    "root": 1,
    "prescale": 2.0,
    "postscale": 0.5,
    "device": "cuda",
    "group": "other#group",
    "group_size": 9,
    "ranks": (0, 1),
    "set_id": 4,
}


def test_every_agree_field_has_a_differing_value_in_this_test():
    assert set(_DIFFERENT) == {f.attr for f in AGREE_FIELDS}


@pytest.mark.parametrize("field", AGREE_FIELDS, ids=lambda f: f.attr)
def test_the_agree_fields_drive_the_mismatch_message(field):
    base = Request("w", "allreduce", "float32", (2,), device="cpu")
    other = dataclasses.replace(base, **{field.attr: _DIFFERENT[field.attr]})
    message = disagreement("w", {0: base, 1: other})
    assert message is not None
    assert f"ranks disagree on {field.label} (rank 0: " in message
    assert f"Every rank must submit the same {field.label} for one name." in message


def test_the_mismatch_message_shows_ranks_as_a_list():
    a, b = Request("p", "ps_add", ranks=(0, 1)), Request("p", "ps_add", ranks=(0, 2))
    assert "(rank 0: [0, 1], rank 1: [0, 2])" in (disagreement("p", {0: a, 1: b}) or "")


def test_shapes_may_differ_only_in_the_first_dimension_for_allgather():
    a = Request("g", "allgather", "float32", (2, 3))
    assert disagreement("g", {0: a, 1: dataclasses.replace(a, shape=(5, 3))}) is None
    msg = disagreement("g", {0: a, 1: dataclasses.replace(a, shape=(2, 4))})
    assert msg is not None and "may differ only in the first dimension" in msg
    r = Request("r", "allreduce", "float32", (2,))
    msg = disagreement("r", {0: r, 1: dataclasses.replace(r, shape=(3,))})
    assert msg is not None and "ranks disagree on shape" in msg


# -- the drift the protocol fixed -------------------------------------------------------


def test_every_builder_uses_one_default_root(monkeypatch):
    """The tensor ops and the process-set changes once sent different roots (-1 and 0)."""
    from ringcore.runtime import process_sets as _process_sets
    from ringcore.runtime import state as _state
    from ringcore.torch import _async

    sent: list[Request] = []

    class _Engine:
        def auto_name(self, kind):
            return f"{kind}.noname.0"

        def submit(self, handle, req):
            sent.append(req)
            handle.resolve(1)
            return handle

    monkeypatch.setattr(_state, "engine", lambda: _Engine())
    _process_sets._control_op("ps_add", ranks=(0,))
    sent.append(_async._request("allgather", "x", torch.zeros(2), 0))
    assert [r.root for r in sent] == [DEFAULT_ROOT, DEFAULT_ROOT]
    assert Request("x", "barrier").root == DEFAULT_ROOT


@pytest.mark.parametrize(
    ("dtype", "summed", "expected"),
    [
        (torch.complex64, [2 + 4j, -6 + 2j], [1 + 2j, -3 + 1j]),
        (torch.float32, [3.0, -5.0], [1.5, -2.5]),
        (torch.int64, [3, -5], [1, -2]),  # truncated, as Horovod's core
    ],
)
def test_average_divides_complex_floating_and_integer_sums_alike(dtype, summed, expected):
    """allreduce and reducescatter share one Average (reducescatter once lacked complex)."""
    t = torch.tensor(summed, dtype=dtype)
    average_(t, 2)
    assert t.tolist() == expected
