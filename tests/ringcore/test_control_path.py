"""The engine's control path for repeated names, on real Gloo ranks: a cached name travels
as its bare cache id both ways and agrees without the field-by-field comparison, a changed
shape or dtype under a cached name falls back to the full request (and a disagreement
still raises on every rank), async ops in different orders still match, and a joined rank
reads bare ids too. Observed through ``Engine.stats`` and ``Coordinator.stats``, never time.
The ranks run with ``RING_FAST_LANE=0``: on one host a blocking cached op would otherwise
skip the coordinator altogether (tests/ringcore/test_fast_lane.py covers that lane).
"""

from __future__ import annotations

import pytest

from ringcore.testing import run_workers


def _control_path_worker() -> dict:
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as _state

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    engine, coordinator = _state.current.engine, _state.current.coordinator
    out: dict = {}

    def stats() -> dict:
        got = dict(engine.stats)
        if coordinator is not None:
            got.update(coordinator.stats)
        return got

    def delta(before: dict) -> dict:
        return {k: v - before.get(k, 0) for k, v in stats().items()}

    # 1. one name five times, blocking
    before = stats()
    out["repeat"] = [
        hvd.allreduce(torch.full((4,), float(r + i)), name="cp.x", op=hvd.Sum).tolist()
        for i in range(5)
    ]
    out["repeat_stats"] = delta(before)

    # 2. a new shape for every rank (cache id plus shape), then shape and dtype mismatches
    before = stats()
    out["reshaped"] = hvd.allreduce(torch.ones(6), name="cp.x", op=hvd.Sum).tolist()
    out["reshaped_stats"] = delta(before)
    for label, tensor in (
        ("shape", torch.ones(4 + r)),
        ("dtype", torch.ones(4, dtype=torch.float32 if r == 0 else torch.float64)),
    ):
        try:
            hvd.allreduce(tensor, name="cp.x", op=hvd.Sum)
            out[f"mismatch/{label}"] = None
        except hvd.CollectiveMismatchError as exc:
            out[f"mismatch/{label}"] = str(exc)
    out["after_mismatch"] = hvd.allreduce(torch.ones(4), name="cp.x", op=hvd.Sum).tolist()

    # 3. async ops in opposite orders on the two ranks, three rounds (fused, cached)
    names = [f"cp.a.{i}" for i in range(40)]
    before = stats()
    rounds = []
    for step in range(3):
        order = names if r % 2 == 0 else list(reversed(names))
        handles = {
            nm: hvd.allreduce_async(
                torch.full((8,), float(names.index(nm) + step)), name=nm, op=hvd.Sum
            )
            for nm in order
        }
        rounds.append({nm: hvd.synchronize(h)[0].item() for nm, h in handles.items()})
    out["async"] = rounds
    out["async_stats"] = delta(before)

    # 5. in-place and new-tensor allreduces fused in one batch, and one alone: the
    # engine thread copies a new-tensor op's input (InputHandle) and leaves it as it is
    before = stats()
    inputs = [torch.full((5,), float(i + r)) for i in range(12)]
    handles = [
        (hvd.allreduce_async_ if i % 2 else hvd.allreduce_async)(t, name=f"cp.m.{i}", op=hvd.Sum)
        for i, t in enumerate(inputs)
    ]
    results = [hvd.synchronize(h) for h in handles]
    out["mixed"] = {
        "results": [t.tolist() for t in results],
        "inputs": [t.tolist() for t in inputs],
        "own_storage": [
            res.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()
            and res.untyped_storage().nbytes() == t.untyped_storage().nbytes()
            for res, t in zip(results, inputs)
        ],
    }
    before = stats()
    group_in = [torch.full((4,), float(i * r)) for i in range(6)]
    group_out = hvd.synchronize(hvd.grouped_allreduce_async(group_in, name="cp.g", op=hvd.Sum))
    out["group"] = {
        "results": [t.tolist() for t in group_out],
        "inputs": [t.tolist() for t in group_in],
        "own_storage": len({t.untyped_storage().data_ptr() for t in group_out + group_in}),
    }
    out["group_stats"] = delta(before)
    alone = torch.full((3,), float(r))
    out["alone"] = (
        hvd.synchronize(hvd.allreduce_async(alone, name="cp.alone", op=hvd.Sum)).tolist(),
        alone.tolist(),
    )

    # 4. rank 1 joins after 2 steps of a cached name; rank 0 runs 5: rank 1 reads the
    # bare ids of steps 3..5 while joined and adds zeros
    steps = 5 if r == 0 else 2
    before = stats()
    out["join_sums"] = [
        hvd.allreduce(torch.full((3,), float(r + 1)), name="cp.j", op=hvd.Sum)[0].item()
        for _ in range(steps)
    ]
    out["last"] = hvd.join()
    out["join_stats"] = delta(before)
    out["n"] = n
    hvd.shutdown()
    return out


@pytest.fixture(scope="module")
def results():
    return run_workers(_control_path_worker, np=2, timeout=120, env={"RING_FAST_LANE": "0"})


def test_a_repeated_name_travels_as_its_bare_cache_id_and_agrees_by_id(results):
    for res in results:
        assert res["repeat"] == [[float(1 + 2 * i)] * 4 for i in range(5)]
        st = res["repeat_stats"]
        assert (st["sent_full"], st["sent_id"], st["sent_cached"]) == (1, 4, 0)
        assert st["sent_now"] == 5  # a blocking op sends from its caller's thread
        assert st["entries_compact"] == 4  # the first response carried the id in full
    coord = results[0]["repeat_stats"]
    assert (coord["agreed_by_fields"], coord["agreed_by_id"]) == (1, 4)


def test_a_new_shape_under_a_cached_name_sends_the_id_with_the_shape(results):
    for res in results:
        assert res["reshaped"] == [2.0] * 6
        st = res["reshaped_stats"]
        assert (st["sent_cached"], st["sent_id"], st["entries_compact"]) == (1, 0, 0)
    assert results[0]["reshaped_stats"]["agreed_by_fields"] == 1


@pytest.mark.parametrize(
    "label, needles",
    [("shape", ["shape", "(4,)", "(5,)"]), ("dtype", ["dtype", "float32", "float64"])],
)
def test_a_disagreement_under_a_cached_name_still_raises_on_every_rank(results, label, needles):
    for res in results:
        msg = res[f"mismatch/{label}"]
        assert msg is not None, f"no CollectiveMismatchError for a {label} mismatch"
        assert "cp.x" in msg and all(n in msg for n in needles), msg
        assert res["after_mismatch"] == [2.0] * 4


def test_async_ops_in_opposite_orders_match_through_cache_and_fusion(results):
    for res in results:
        for step, got in enumerate(res["async"]):
            assert got == {f"cp.a.{i}": 2.0 * (i + step) for i in range(40)}
        st = res["async_stats"]
        assert st["sent_full"] == 40 and st["sent_id"] == 80
        assert st["entries_compact"] > 0
    assert results[0]["async_stats"]["agreed_by_id"] == 80


def test_a_joined_rank_reads_bare_cache_ids_and_contributes_zeros(results):
    assert results[0]["join_sums"] == [3.0, 3.0, 1.0, 1.0, 1.0]
    assert results[1]["join_sums"] == [3.0, 3.0]
    assert [res["last"] for res in results] == [0, 0]
    assert results[1]["join_stats"]["entries_compact"] == 4  # its 2nd step + rank 0's 3 more


def test_new_tensor_allreduces_leave_their_inputs_and_get_their_own_storage(results):
    for r, res in enumerate(results):
        got = res["mixed"]
        assert got["results"] == [[float(2 * i + 1)] * 5 for i in range(12)]
        for i, t in enumerate(got["inputs"]):  # odd: in place; even: left as they were
            assert t == ([float(2 * i + 1)] * 5 if i % 2 else [float(i + r)] * 5)
        assert all(got["own_storage"][0::2]), got["own_storage"]
        assert res["alone"] == ([1.0] * 3, [float(r)] * 3)
        # a group is always fused: its new tensors are copies out of the fusion buffer
        group = res["group"]
        assert group["results"] == [[float(i)] * 4 for i in range(6)]
        assert group["inputs"] == [[float(i * r)] * 4 for i in range(6)]
        assert group["own_storage"] == 12  # six inputs, six results: no storage shared
        assert res["group_stats"]["ops_fused"] == 6
