"""What Horovod's own torch suite (test/parallel/test_torch.py, test_timeline.py) relies
on, as our tests: the kinds of error, the dtypes every op carries, gradients of the
grouped ops and of reducescatter, sparse handles, the optimizer's edge cases, the live
timeline and a clean exit without ``shutdown()``. Two Gloo ranks over 127.0.0.1; one
launch records every result, the tests read them."""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ringcore import CollectiveMismatchError, RingError
from ringcore.testing import run_workers

ROOT = Path(__file__).resolve().parents[2]
ALL_DTYPES = (
    "uint8",
    "int8",
    "int16",
    "int32",
    "int64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "bool",
)


def _caught(fn):
    """The exception ``fn()`` raised, as (its classes' names, message), or None."""
    try:
        fn()
    except Exception as exc:
        return ([c.__name__ for c in type(exc).__mro__], str(exc))
    return None


def _dtype_worker(out: dict) -> None:
    import torch

    import ringcore.torch as hvd

    r = hvd.rank()
    for name in ALL_DTYPES:
        dt = getattr(torch, name)
        reduce_op = hvd.Max if dt == torch.bool else hvd.Sum
        x = torch.full((2, 3), r + 1, dtype=dt)
        out[f"dtype/allreduce/{name}"] = hvd.allreduce(x, op=reduce_op)
        out[f"dtype/allgather/{name}"] = hvd.allgather(torch.full((r + 1, 2), r, dtype=dt))
        out[f"dtype/broadcast/{name}"] = hvd.broadcast(torch.full((3,), 5 * r, dtype=dt), 1)
        out[f"dtype/alltoall/{name}"] = hvd.alltoall(torch.tensor([r, r + 1]).to(dt))
        out[f"dtype/reducescatter/{name}"] = hvd.reducescatter(
            torch.full((4, 2), r + 1, dtype=dt), op=reduce_op
        )
        out[f"dtype/grouped_allgather/{name}"] = hvd.grouped_allgather(
            [torch.full((1,), r, dtype=dt), torch.full((2, 2), r, dtype=dt)]
        )


def _error_worker(out: dict) -> None:
    import torch

    import ringcore.torch as hvd

    r = hvd.rank()
    out["err/shape"] = _caught(lambda: hvd.allreduce(torch.ones(17 + r)))
    out["err/dtype"] = _caught(
        lambda: hvd.allgather(torch.ones(3, dtype=torch.int32 if r == 0 else torch.float32))
    )
    out["err/first_dims"] = _caught(lambda: hvd.allgather(torch.ones(2, 10 * (r + 1))))
    out["err/root"] = _caught(lambda: hvd.broadcast(torch.ones(3), root_rank=r))
    out["err/rs_adasum"] = _caught(lambda: hvd.reducescatter(torch.ones(4), op=hvd.Adasum))
    out["after_errors"] = hvd.allreduce(torch.ones(2), op=hvd.Sum)  # the ring is still fine


def _grad_worker(out: dict) -> None:
    import torch

    import ringcore.torch as hvd

    r = hvd.rank()
    xs = [torch.full((4,), float(r + 1), requires_grad=True), torch.ones(2, 2, requires_grad=True)]
    ys = hvd.grouped_allreduce(xs, op=hvd.Sum)
    sum(y.sum() for y in ys).backward()
    out["grad/grouped_allreduce"] = [x.grad for x in xs]
    out["grouped_allreduce/requires_grad"] = all(y.requires_grad for y in ys)

    xs = [torch.ones(r + 1, 2, requires_grad=True), torch.ones(3, requires_grad=True)]
    ys = hvd.grouped_allgather(xs)
    sum((y * (i + 1)).sum() for i, y in enumerate(ys)).backward()
    out["grad/grouped_allgather"] = [x.grad for x in xs]
    out["grouped_allgather/shapes"] = [tuple(y.shape) for y in ys]

    for op in ("Sum", "Average"):
        x = torch.ones(4, 3, requires_grad=True)
        hvd.reducescatter(x, op=getattr(hvd, op)).backward(torch.ones(2, 3))
        out[f"grad/reducescatter/{op}"] = x.grad
        xs = [torch.ones(4, requires_grad=True), torch.ones(2, 2, requires_grad=True)]
        ys = hvd.grouped_reducescatter(xs, op=getattr(hvd, op))
        sum(y.sum() for y in ys).backward()
        out[f"grad/grouped_reducescatter/{op}"] = [x.grad for x in xs]

    out["grouped_reducescatter/scaled"] = hvd.grouped_reducescatter(
        [torch.ones(4), torch.ones(2, 3)], op=hvd.Sum, prescale_factor=3.0, postscale_factor=0.5
    )


def _sparse_worker(out: dict) -> None:
    import torch

    import ringcore.torch as hvd

    r = hvd.rank()
    dense = torch.zeros(5, 2)
    dense[r] = 1.0 + r
    handle = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp", op=hvd.Sum)
    out["sparse/callable"] = handle().to_dense()
    handle2 = hvd.sparse_allreduce_async(dense.to_sparse(), name="sp2", op=hvd.Average)
    out["sparse/synchronize"] = hvd.synchronize(handle2).to_dense()


def _optimizer_worker(out: dict) -> None:
    import warnings

    import torch

    import ringcore.torch as hvd

    r = hvd.rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    opt = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1
    )
    opt = hvd.DistributedOptimizer(opt)
    out["opt/names"] = sorted(opt._parameter_names.values())

    model(torch.full((1, 3), float(r))).sum().backward()
    opt.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    out["opt/step_warning"] = [str(w.message) for w in caught]

    # sparse_as_dense: the wrapped SparseAdam still gets a sparse, averaged gradient
    emb = torch.nn.Embedding(6, 2, sparse=True)
    torch.nn.init.ones_(emb.weight)
    sparse_opt = hvd.DistributedOptimizer(
        torch.optim.SparseAdam(list(emb.parameters()), lr=0.1),
        named_parameters=emb.named_parameters(),
        sparse_as_dense=True,
    )
    emb(torch.tensor([r, 4])).sum().backward()
    sparse_opt.synchronize()
    grad = emb.weight.grad
    out["opt/sparse_as_dense/is_sparse"] = grad.is_sparse
    out["opt/sparse_as_dense/grad"] = grad.to_dense()
    with sparse_opt.skip_synchronize():
        sparse_opt.step()

    # a rank outside the optimizer's process set keeps its own gradients
    only0 = hvd.add_process_set([0])
    lin = torch.nn.Linear(2, 1, bias=False)
    torch.nn.init.ones_(lin.weight)
    set_opt = hvd.DistributedOptimizer(
        torch.optim.SGD(lin.parameters(), lr=1.0),
        named_parameters=lin.named_parameters(),
        process_set=only0,
    )
    lin(torch.full((1, 2), float(r + 1))).sum().backward()
    set_opt.step()
    out["opt/process_set/weight"] = lin.weight.detach().clone()
    hvd.remove_process_set(only0)

    # broadcast_optimizer_state before any step: zero grads where a grad will come
    frozen = torch.nn.Parameter(torch.ones(2), requires_grad=False)
    trained = torch.nn.Parameter(torch.ones(2))
    state_opt = torch.optim.SGD([frozen, trained], lr=0.1, momentum=0.9)
    hvd.broadcast_optimizer_state(state_opt, root_rank=0)
    out["opt/no_grad/frozen"] = frozen.grad
    out["opt/no_grad/trained"] = trained.grad


def _compat_worker() -> dict:
    import ringcore.torch as hvd

    hvd.init(process_sets="dynamic")
    out: dict = {"rank": hvd.rank(), "size": hvd.size()}
    for step in (_dtype_worker, _error_worker, _grad_worker, _sparse_worker, _optimizer_worker):
        step(out)
    hvd.barrier()
    return out


@pytest.fixture(scope="module")
def compat() -> list[dict]:
    return run_workers(_compat_worker, np=2, timeout=240)


# -- errors --------------------------------------------------------------------------


def test_mismatch_error_is_a_runtime_error_and_a_value_error_under_ring_error():
    assert issubclass(CollectiveMismatchError, RuntimeError)
    assert issubclass(CollectiveMismatchError, ValueError)
    assert issubclass(CollectiveMismatchError, RingError)
    err = pickle.loads(pickle.dumps(CollectiveMismatchError("allreduce of 'x': shapes differ")))
    assert type(err) is CollectiveMismatchError and str(err) == "allreduce of 'x': shapes differ"


@pytest.mark.parametrize("case", ["shape", "dtype", "first_dims", "root"])
def test_rank_disagreements_raise_runtime_error_on_every_rank(compat, case):
    for out in compat:
        classes, message = out[f"err/{case}"]
        assert "RuntimeError" in classes and "CollectiveMismatchError" in classes, message
        assert "rank 0" in message and "rank 1" in message


def test_reducescatter_with_adasum_raises_runtime_error_and_the_ring_goes_on(compat):
    for out in compat:
        classes, message = out["err/rs_adasum"]
        assert "RuntimeError" in classes and "Adasum" in message
        assert out["after_errors"].tolist() == [2.0, 2.0]


# -- dtypes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_op_carries_every_horovod_dtype(compat, dtype):
    import torch

    dt = getattr(torch, dtype)
    is_bool = dt == torch.bool
    for out in compat:
        r = out["rank"]
        reduced = out[f"dtype/allreduce/{dtype}"]
        assert reduced.dtype == dt
        assert reduced.double().tolist() == [[1.0 if is_bool else 3.0] * 3] * 2
        gathered = out[f"dtype/allgather/{dtype}"]
        assert gathered.dtype == dt and gathered.double().tolist() == [[0, 0], [1, 1], [1, 1]]
        bcast = out[f"dtype/broadcast/{dtype}"]
        assert (
            bcast.dtype == dt and bcast.double().tolist() == [float(bool(5)) if is_bool else 5] * 3
        )
        a2a = out[f"dtype/alltoall/{dtype}"]
        expect_a2a = [float(r), float(1 + r)] if not is_bool else [float(bool(r)), 1.0]
        assert a2a.dtype == dt and a2a.double().tolist() == expect_a2a
        rs = out[f"dtype/reducescatter/{dtype}"]
        assert rs.dtype == dt and rs.double().tolist() == [[1.0 if is_bool else 3.0] * 2] * 2
        g1, g2 = out[f"dtype/grouped_allgather/{dtype}"]
        assert g1.dtype == dt and g1.double().tolist() == [0.0, 1.0]
        assert g2.shape == (4, 2)


# -- gradients ------------------------------------------------------------------------


def test_grouped_allreduce_is_differentiable_like_allreduce(compat):
    for out in compat:
        assert out["grouped_allreduce/requires_grad"]
        g1, g2 = out["grad/grouped_allreduce"]
        assert g1.tolist() == [2.0] * 4  # the Sum of the ones of both ranks
        assert g2.tolist() == [[2.0, 2.0], [2.0, 2.0]]


def test_grouped_allgather_gradient_is_this_ranks_rows_of_the_averaged_gradient(compat):
    for out in compat:
        r = out["rank"]
        assert out["grouped_allgather/shapes"] == [(3, 2), (6,)]
        g1, g2 = out["grad/grouped_allgather"]
        assert g1.tolist() == [[1.0, 1.0]] * (r + 1)
        assert g2.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize("op,expected", [("Sum", 2.0), ("Average", 1.0)])
def test_reducescatter_gradient_is_allgather_times_size_for_sum(compat, op, expected):
    for out in compat:
        assert out[f"grad/reducescatter/{op}"].tolist() == [[expected] * 3] * 4
        g1, g2 = out[f"grad/grouped_reducescatter/{op}"]
        assert g1.tolist() == [expected] * 4
        assert g2.tolist() == [[expected] * 2] * 2


def test_grouped_reducescatter_takes_prescale_and_postscale_factors(compat):
    for out in compat:
        a, b = out["grouped_reducescatter/scaled"]
        assert a.tolist() == [3.0, 3.0]  # 2 ranks x 1 x 3.0 x 0.5
        assert b.tolist() == [[3.0] * 3]


# -- sparse ---------------------------------------------------------------------------


def test_sparse_allreduce_handle_is_callable_and_synchronizable(compat):
    import torch

    expected = torch.zeros(5, 2)
    expected[0], expected[1] = 1.0, 2.0
    for out in compat:
        assert torch.equal(out["sparse/callable"], expected)
        assert torch.equal(out["sparse/synchronize"], expected / 2)


# -- optimizer ------------------------------------------------------------------------


def test_optimizer_without_named_parameters_names_every_parameter_alike_on_every_rank(compat):
    names = compat[0]["opt/names"]
    assert len(names) == len(set(names)) == 4
    assert all(out["opt/names"] == names for out in compat)


def test_step_after_synchronize_without_skip_synchronize_warns(compat):
    for out in compat:
        assert len(out["opt/step_warning"]) == 1
        assert (
            "optimizer.step() called without optimizer.skip_synchronize()"
            in (out["opt/step_warning"][0])
        )


def test_sparse_as_dense_hands_the_optimizer_a_sparse_averaged_gradient(compat):
    for out in compat:
        assert out["opt/sparse_as_dense/is_sparse"]
        grad = out["opt/sparse_as_dense/grad"]
        assert grad[:2].tolist() == [[0.5, 0.5], [0.5, 0.5]]  # row r from rank r only
        assert grad[4].tolist() == [1.0, 1.0]  # row 4 from both ranks


def test_rank_outside_the_optimizers_process_set_steps_on_its_own_gradient(compat):
    # weight 1, lr 1, input r + 1: rank 0 (the set's only member) and rank 1 (outside
    # it) each step on their own gradient; no rank waits for the other
    assert compat[0]["opt/process_set/weight"].tolist() == [[0.0, 0.0]]
    assert compat[1]["opt/process_set/weight"].tolist() == [[-1.0, -1.0]]


def test_broadcast_optimizer_state_gives_zero_grads_to_trained_parameters_only(compat):
    for out in compat:
        assert out["opt/no_grad/frozen"] is None
        assert out["opt/no_grad/trained"].tolist() == [0.0, 0.0]


# -- timeline and exit ------------------------------------------------------------------


def _live_timeline_worker(path: str, marks: bool) -> str:
    import time

    import torch

    import ringcore.torch as hvd

    hvd.init()
    if marks:
        hvd.start_timeline(path, mark_cycles=True)
    hvd.allreduce(torch.ones(3), name="test_allreduce")
    text = ""
    if hvd.rank() == 0:
        deadline = time.monotonic() + 2.0
        while "ALLREDUCE" not in text and time.monotonic() < deadline:
            with open(path) as f:
                text = f.read()
            time.sleep(0.05)
    hvd.barrier()
    return text


def test_timeline_is_readable_while_the_job_runs_with_horovods_names(tmp_path):
    path = str(tmp_path / "timeline.json")
    env = {"HOROVOD_TIMELINE": path, "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    text = run_workers(_live_timeline_worker, np=2, args=(path, False), env=env, timeout=90)[0]
    for needle in (
        "allreduce.test_allreduce",
        "NEGOTIATE_ALLREDUCE",
        '"ALLREDUCE"',
        "CYCLE_START",
        "start_time_since_epoch_in_micros",
    ):
        assert needle in text, (needle, text)


def test_timeline_dynamic_starts_no_file_until_start_timeline(tmp_path, monkeypatch):
    path = str(tmp_path / "timeline.json")
    monkeypatch.chdir(tmp_path)  # a file named DYNAMIC would land in the workers' folder
    env = {"HOROVOD_TIMELINE": "DYNAMIC"}
    text = run_workers(_live_timeline_worker, np=2, args=(path, True), env=env, timeout=90)[0]
    assert not (tmp_path / "DYNAMIC").exists()
    assert "allreduce.test_allreduce" in text and "CYCLE_START" in text


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_script_without_shutdown_exits_cleanly_and_completes_its_timeline(tmp_path):
    timeline = tmp_path / "timeline.json"
    script = tmp_path / "train.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            import ringcore.torch as hvd

            hvd.init()
            hvd.allreduce(torch.ones(4), name="grad")
            hvd.allgather(torch.ones(2))
            # no hvd.shutdown(): interpreter exit must leave the ring cleanly
            """
        )
    )
    port = _free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    procs = []
    for rank in range(2):
        env = dict(
            base,
            PYTHONPATH=str(ROOT),
            HOROVOD_RANK=str(rank),
            HOROVOD_SIZE="2",
            HOROVOD_LOCAL_RANK=str(rank),
            HOROVOD_LOCAL_SIZE="2",
            HOROVOD_CROSS_RANK="0",
            HOROVOD_CROSS_SIZE="1",
            HOROVOD_HOSTNAME="localhost",
            HOROVOD_TIMELINE=str(timeline),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    events = json.loads(timeline.read_text())  # closed by the exit-time shutdown
    assert "allreduce.grad" in {e["args"]["name"] for e in events if e.get("ph") == "M"}
