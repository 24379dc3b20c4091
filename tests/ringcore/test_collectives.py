"""Collectives on 2 and 3 Gloo ranks (real processes over 127.0.0.1), checked against
values computed by hand. Each fixture runs one worker function per rank count that
records every op's result; the tests then read those results."""

from __future__ import annotations

import pytest

from ringcore import CollectiveMismatchError, WorkerError
from ringcore.testing import run_workers

DTYPES = ("float32", "float64", "int64")


def _collectives_worker():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {"rank": r, "size": n}
    for name in DTYPES:
        dt = getattr(torch, name)
        x = torch.tensor([r + 1, 10 * (r + 1), -r], dtype=dt)
        out[f"sum/{name}"] = hvd.allreduce(x, op=hvd.Sum)
        out[f"avg/{name}"] = hvd.allreduce(x)
        out[f"min/{name}"] = hvd.allreduce(x, op=hvd.Min)
        out[f"max/{name}"] = hvd.allreduce(x, op=hvd.Max)
        out[f"prod/{name}"] = hvd.allreduce(x, op=hvd.Product)
        out[f"input_untouched/{name}"] = x
        y = x.clone()
        hvd.allreduce_(y, op=hvd.Sum)
        out[f"inplace/{name}"] = y
        out[f"gather/{name}"] = hvd.allgather(torch.full((r + 1, 2), r, dtype=dt))
        out[f"bcast/{name}"] = hvd.broadcast(torch.full((2,), 7 * r, dtype=dt), root_rank=n - 1)
        out[f"a2a/{name}"] = hvd.alltoall(torch.arange(n, dtype=dt) + 100 * r)
        splits = [i + 1 for i in range(n)]  # rank j gets j+1 rows from everyone
        out[f"a2a_splits/{name}"] = hvd.alltoall(
            torch.full((sum(splits),), r, dtype=dt), splits=splits
        )
        out[f"rs/{name}"] = hvd.reducescatter(
            torch.arange(2 * n + 1, dtype=dt).repeat(2, 1).T.contiguous(), op=hvd.Sum
        )
    out["scaled"] = hvd.allreduce(
        torch.tensor([1.0]), op=hvd.Sum, prescale_factor=2.0, postscale_factor=0.5
    )
    out["grouped"] = hvd.grouped_allreduce(
        [torch.tensor([1.0 * r]), torch.tensor([[r, r]])], op=hvd.Sum
    )
    out["fp16"] = hvd.allreduce(torch.tensor([0.1 * (r + 1)]), compression=hvd.Compression.fp16)
    out["bool_max"] = hvd.allreduce(torch.tensor([r == 0, False]), op=hvd.Max)
    out["object"] = hvd.broadcast_object({"from": r, "list": list(range(r))}, root_rank=1)
    out["objects"] = hvd.allgather_object(("rank", r))
    hvd.barrier()
    try:
        hvd.allgather(torch.zeros(2, r + 1))
        out["mismatch"] = None
    except CollectiveMismatchError as exc:
        out["mismatch"] = str(exc)
    return out


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def results(request):
    return run_workers(_collectives_worker, np=request.param, timeout=180)


def _all(results, key):
    return [res[key].tolist() for res in results]


@pytest.mark.parametrize("dtype", DTYPES)
def test_allreduce_sum_average_min_max_product(results, dtype):
    n = len(results)
    xs = [[r + 1, 10 * (r + 1), -r] for r in range(n)]
    col = list(zip(*xs))
    total = [sum(c) for c in col]
    prod = [1, 1, 1]
    for x in xs:
        prod = [p * v for p, v in zip(prod, x)]
    for res in results:
        assert res[f"sum/{dtype}"].tolist() == total
        assert res[f"min/{dtype}"].tolist() == [min(c) for c in col]
        assert res[f"max/{dtype}"].tolist() == [max(c) for c in col]
        assert res[f"prod/{dtype}"].tolist() == prod
        assert res[f"inplace/{dtype}"].tolist() == total
        assert res[f"input_untouched/{dtype}"].tolist() == xs[res["rank"]]
        avg = res[f"avg/{dtype}"].tolist()
        if dtype == "int64":  # integers truncate toward zero, as Horovod's core does
            assert avg == [int(t / n) for t in total]
        else:
            assert avg == pytest.approx([t / n for t in total])
        assert str(res[f"avg/{dtype}"].dtype) == f"torch.{dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_allgather_concatenates_uneven_first_dimensions_in_rank_order(results, dtype):
    n = len(results)
    expected = [[r, r] for r in range(n) for _ in range(r + 1)]
    assert _all(results, f"gather/{dtype}") == [expected] * n


@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_gives_every_rank_the_roots_tensor(results, dtype):
    n = len(results)
    assert _all(results, f"bcast/{dtype}") == [[7 * (n - 1)] * 2] * n


@pytest.mark.parametrize("dtype", DTYPES)
def test_alltoall_with_and_without_splits(results, dtype):
    n = len(results)
    for res in results:
        me = res["rank"]
        assert res[f"a2a/{dtype}"].tolist() == [me + 100 * src for src in range(n)]
        received, rsplits = res[f"a2a_splits/{dtype}"]
        assert rsplits.tolist() == [me + 1] * n
        assert received.tolist() == [src for src in range(n) for _ in range(me + 1)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_reducescatter_gives_the_first_ranks_one_extra_row(results, dtype):
    n = len(results)
    rows = 2 * n + 1
    base, extra = divmod(rows, n)
    start = 0
    for res in results:
        me = res["rank"]
        count = base + (1 if me < extra else 0)
        assert res[f"rs/{dtype}"].tolist() == [[n * i, n * i] for i in range(start, start + count)]
        start += count


def test_scale_factors_grouped_fp16_and_bool(results):
    n = len(results)
    for res in results:
        r = res["rank"]
        assert res["scaled"].tolist() == [float(n)]  # 2 * 1 summed n times, halved
        g0, g1 = res["grouped"]
        assert g0.tolist() == [float(sum(range(n)))] and g1.tolist() == [[sum(range(n))] * 2]
        assert res["fp16"].dtype.is_floating_point and str(res["fp16"].dtype) == "torch.float32"
        assert res["fp16"].item() == pytest.approx(0.1 * (n + 1) / 2, rel=1e-3)
        assert res["bool_max"].tolist() == [True, False]
        assert res["object"] == {"from": 1, "list": [0]}
        assert res["objects"] == [("rank", i) for i in range(n)]
        assert r in range(n)


def test_allgather_of_shapes_differing_beyond_dim0_raises_on_every_rank(results):
    for res in results:
        assert res["mismatch"] is not None
        assert "rank 0: (2, 1)" in res["mismatch"] and "rank 1: (2, 2)" in res["mismatch"]


def _failing_worker():
    import ringcore.torch as hvd

    hvd.init()
    if hvd.rank() == 1:
        raise ZeroDivisionError("rank one divides by zero")
    hvd.barrier()
    return "unreachable"


def test_run_workers_raises_the_failing_ranks_error_with_traceback():
    with pytest.raises(WorkerError) as info:
        run_workers(_failing_worker, np=2, timeout=60)
    err = info.value
    assert err.rank == 1 and err.error_type == "ZeroDivisionError"
    assert "rank one divides by zero" in str(err) and "_failing_worker" in err.traceback


def _training_worker(steps, seed, bpps):
    import torch

    import ringcore.torch as hvd

    hvd.init()
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    if hvd.rank() != 0:  # make ranks differ, then broadcast must fix it
        for p in model.parameters():
            p.data.add_(1.0)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(opt, root_rank=0)
    opt = hvd.DistributedOptimizer(
        opt, named_parameters=model.named_parameters(), backward_passes_per_step=bpps
    )
    gen = torch.Generator().manual_seed(123)
    data = [
        (torch.randn(8, 4, generator=gen), torch.randn(8, 1, generator=gen)) for _ in range(steps)
    ]
    per = 8 // hvd.size()
    for x, y in data:
        opt.zero_grad()
        xs, ys = (
            x[hvd.rank() * per : (hvd.rank() + 1) * per],
            y[hvd.rank() * per : (hvd.rank() + 1) * per],
        )
        torch.nn.functional.mse_loss(model(xs), ys).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()], isinstance(opt, torch.optim.Adam)


def test_distributed_optimizer_matches_one_process_on_the_concatenated_batch():
    import torch

    two = run_workers(_training_worker, np=2, args=(5, 0, 1), timeout=120)
    one = run_workers(_training_worker, np=1, args=(5, 0, 1), timeout=120)
    assert two[0][1] is True  # still an Adam, as Horovod's wrapper is
    for a, b, c in zip(two[0][0], two[1][0], one[0][0]):
        assert torch.equal(a, b)
        assert torch.allclose(a, c, atol=1e-6)
