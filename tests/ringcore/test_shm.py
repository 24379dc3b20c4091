"""The shared-memory data plane (``ringcore.shm``) on 2 and 3 real local ranks.

Worker functions create the :class:`ShmGroup` directly over the job's TCPStore on
127.0.0.1 (``run_workers`` hosts it). Each op's result is checked in the worker
against a reference computed from every rank's input (the inputs are a function of
the rank, so each rank can rebuild all of them). Slots of 4 KiB make most tensors
span several chunks.
"""

from __future__ import annotations

import datetime
import glob
import logging
import os
import signal
import time
import uuid

import pytest
import torch

from ringcore import CollectiveMismatchError, RingError, WorkerError
from ringcore._ops import ReduceOp
from ringcore.shm.group import ShmGroup, shm_enabled
from ringcore.shm.group import _split as split_ranges
from ringcore.shm.reduce import resolve
from ringcore.shm.segment import Layout
from ringcore.testing import run_workers

SLOT = 4096
DTYPES = (
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
)
OPS = (ReduceOp.Sum, ReduceOp.Average, ReduceOp.Min, ReduceOp.Max, ReduceOp.Product)


def _prefix() -> str:
    return f"shmtest-{uuid.uuid4().hex[:10]}"


def _segments(prefix: str) -> list[str]:
    return glob.glob(f"/dev/shm/ringshm-{prefix}-*")


def _join(
    prefix: str, timeout_s: float = 20.0, slot_bytes: int = SLOT, ranks: list[int] | None = None
) -> ShmGroup | None:
    """The worker's side: this rank's group over the job's store (``ranks``: the job's
    ranks of the local ranks, which failures name)."""
    import torch.distributed as dist

    store = dist.TCPStore(
        os.environ["RING_STORE_ADDR"],
        int(os.environ["RING_STORE_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    rank, size = int(os.environ["RING_RANK"]), int(os.environ["RING_SIZE"])
    return ShmGroup.create(
        dist.PrefixStore(prefix, store),
        prefix,
        rank,
        size,
        timeout_s=timeout_s,
        slot_bytes=slot_bytes,
        ranks=ranks,
    )


def _input(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + DTYPES.index(dtype))
    if dtype == torch.bool:
        return torch.rand(numel, generator=g) > 0.5
    if dtype.is_complex:
        return torch.complex(torch.rand(numel, generator=g), torch.rand(numel, generator=g)).to(
            dtype
        )
    low = 0 if dtype == torch.uint8 else -3
    return torch.randint(low, 4, (numel,), generator=g).to(dtype)


def _reference(inputs: list[torch.Tensor], op: ReduceOp) -> torch.Tensor:
    wide = torch.stack(
        [x.to(torch.complex128 if x.dtype.is_complex else torch.float64) for x in inputs]
    )
    if op in (ReduceOp.Sum, ReduceOp.Average):
        out = wide.sum(0)
    elif op == ReduceOp.Product:
        out = wide.prod(0)
    elif op == ReduceOp.Min:
        out = wide.real.min(0).values
    else:
        out = wide.real.max(0).values
    if op == ReduceOp.Average:
        out = out / len(inputs)
        if not (inputs[0].dtype.is_floating_point or inputs[0].dtype.is_complex):
            out = out.trunc()
    if inputs[0].dtype == torch.bool:
        return out != 0
    return out.to(inputs[0].dtype)


def _close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, (what, a.dtype, b.dtype, a.shape, b.shape)
    if a.dtype.is_floating_point or a.dtype.is_complex:
        tol = 2e-2 if a.element_size() <= 2 else 1e-5
        assert torch.allclose(a.to(torch.complex128), b.to(torch.complex128), rtol=tol, atol=tol), (
            what
        )
    else:
        assert torch.equal(a, b), (what, a[:8], b[:8])


def _check_allreduce(g: ShmGroup, r: int, n: int) -> int:
    checked = 0
    for dtype in DTYPES:
        for op in OPS:
            try:
                resolve(op, dtype)
            except ValueError:
                continue
            # one slot (every rank reduces it whole) and > one 4 KiB slot (chunks)
            for numel in (300, 3000 if dtype != torch.bool else 5000):
                inputs = [_input(k, dtype, numel) for k in range(n)]
                x = inputs[r].clone()
                assert g.allreduce_(x, op) is x
                _close(x, _reference(inputs, op), f"allreduce {op.name} {dtype} {numel}")
                checked += 1
    return checked


def _check_scaled_and_strings(g: ShmGroup, r: int, n: int) -> None:
    inputs = [torch.arange(2500, dtype=torch.float32) * (k + 1) for k in range(n)]
    x = inputs[r].view(50, 50).clone()
    g.allreduce_(x, "average", prescale=0.5, postscale=3.0)
    want = torch.stack([t * 0.5 for t in inputs]).sum(0) / n * 3.0
    _close(x.view(-1), want, "allreduce prescale/postscale")
    y = torch.full((7,), r + 1, dtype=torch.int32)
    g.allreduce_(y, "sum", prescale=2.5)  # integers: multiply in float64, truncate
    _close(
        y,
        torch.full((7,), sum(int(2.5 * (k + 1)) for k in range(n)), dtype=torch.int32),
        "int prescale",
    )
    z = torch.tensor(5.0 + r)  # a 0-d tensor
    g.allreduce_(z, ReduceOp.Max)
    assert z.item() == 4.0 + n


def _check_allgather(g: ShmGroup, r: int, n: int) -> None:
    for dtype in (torch.float64, torch.int8, torch.bool, torch.bfloat16):
        parts = [_input(k, dtype, 700 * (k + 1) * 3).view(-1, 3) for k in range(n)]
        _close(g.allgather(parts[r]), torch.cat(parts), f"allgather {dtype}")
    empty = [torch.zeros((0 if k == 0 else 2), 4) for k in range(n)]
    _close(g.allgather(empty[r]), torch.cat(empty), "allgather with an empty rank")
    # into a given output (equal sizes, over several slots): written in place
    parts = [_input(k, torch.float32, 3000) for k in range(n)]
    into = torch.full((n, 3000), -1.0)
    assert g.allgather(parts[r].view(1, -1), out=into) is into
    _close(into, torch.stack(parts), "allgather into out")
    with pytest.raises(ValueError, match="out must be contiguous"):  # before any round
        g.allgather(parts[r].view(1, -1), out=torch.empty(n, 2999))


def _check_reducescatter(g: ShmGroup, r: int, n: int) -> None:
    for rows in (7, 1500):
        for dtype, op in ((torch.float32, ReduceOp.Sum), (torch.int64, ReduceOp.Max)):
            inputs = [_input(k, dtype, rows * 3).view(rows, 3) for k in range(n)]
            base, extra = divmod(rows, n)
            start = r * base + min(r, extra)
            want = _reference(inputs, op)[start : start + base + (1 if r < extra else 0)]
            _close(g.reducescatter(inputs[r], op), want, f"reducescatter {rows} {dtype}")
    inputs = [_input(k, torch.float32, n * 2000).view(n, 2000) for k in range(n)]
    into = torch.empty(1, 2000)
    assert g.reducescatter(inputs[r], ReduceOp.Sum, out=into) is into
    _close(into, _reference(inputs, ReduceOp.Sum)[r : r + 1], "reducescatter into out")
    with pytest.raises(ValueError, match="out must be contiguous"):
        g.reducescatter(inputs[r], ReduceOp.Sum, out=torch.empty(2, 2000)[:, :1000])
    x = torch.ones(5, 2) * (r + 1)
    got = g.reducescatter(x, ReduceOp.Average, prescale=2.0, postscale=0.5)
    assert torch.allclose(got, torch.full_like(got, (n + 1) / 2))


def _check_alltoall(g: ShmGroup, r: int, n: int) -> None:
    def splits_of(k: int) -> list[int]:
        return [(k + 2 * j) % 3 * 400 for j in range(n)]  # some zero, some > a slot

    def rows_of(k: int) -> torch.Tensor:
        total = sum(splits_of(k))
        return (torch.arange(total * 2, dtype=torch.int32) + 100_000 * k).view(total, 2)

    out, recv = g.alltoall(rows_of(r), splits_of(r))
    parts = []
    for k in range(n):
        s = splits_of(k)
        parts.append(rows_of(k)[sum(s[:r]) : sum(s[: r + 1])])
    _close(out, torch.cat(parts), "alltoall")
    assert recv.tolist() == [splits_of(k)[r] for k in range(n)]
    even, _ = g.alltoall(torch.arange(n, dtype=torch.float64) + 10 * r)
    assert even.tolist() == [10.0 * k + r for k in range(n)]


def _check_broadcast(g: ShmGroup, r: int, n: int) -> None:
    for root in range(n):
        x = _input(r, torch.float32, 3 * SLOT) + 10 * r  # > one bank
        want = _input(root, torch.float32, 3 * SLOT) + 10 * root
        assert g.broadcast_(x, root) is x
        _close(x, want, f"broadcast from {root}")
    b = torch.tensor([r == 1, True])
    g.broadcast_(b, 1)
    assert b.tolist() == [True, True]


def _every_op_worker(prefix: str) -> dict:
    g = _join(prefix)
    assert g is not None
    r, n = g.local_rank, g.local_size
    left = _segments(prefix)  # create() returns after the unlink
    checked = _check_allreduce(g, r, n)
    _check_scaled_and_strings(g, r, n)
    _check_allgather(g, r, n)
    _check_reducescatter(g, r, n)
    _check_alltoall(g, r, n)
    _check_broadcast(g, r, n)
    g.barrier()
    g.close()
    return {"checked": checked, "segments_after_create": left}


@pytest.fixture(scope="module", params=[2, 3], ids=["2ranks", "3ranks"])
def every_op(request):
    prefix = _prefix()
    results = run_workers(_every_op_worker, np=request.param, args=(prefix,), timeout=300)
    return prefix, results


def test_every_op_matches_the_reference_on_every_rank(every_op):
    _, results = every_op
    assert all(res["checked"] == results[0]["checked"] > 80 for res in results)


def test_segment_is_unlinked_once_every_rank_mapped_it(every_op):
    prefix, results = every_op
    assert all(res["segments_after_create"] == [] for res in results)
    assert _segments(prefix) == []


def _random_ops_worker(prefix: str, count: int) -> int:
    """``count`` ops drawn from one seed (alike on every rank): kinds and sizes mixed, so
    that every op starts on either bank after ops of every length."""
    import random

    g = _join(prefix)
    assert g is not None
    r, n, rng = g.local_rank, g.local_size, random.Random(7)
    for i in range(count):
        numel = rng.choice([0, 1, 5, 1000, 1024, 3000])
        inputs = [torch.arange(numel, dtype=torch.float64) * (k + 1) + i for k in range(n)]
        kind = rng.choice(["allreduce", "allgather", "broadcast", "reducescatter", "barrier"])
        if kind == "allreduce":
            got = g.allreduce_(inputs[r].clone(), "sum")
            want = torch.stack(inputs).sum(0)
        elif kind == "allgather":
            got, want = (
                g.allgather(inputs[r][: numel - r]),
                torch.cat([x[: numel - k] for k, x in enumerate(inputs)]),
            )
        elif kind == "broadcast":
            root = i % n
            got, want = g.broadcast_(inputs[r].clone(), root), inputs[root]
        elif kind == "reducescatter":
            base, extra = divmod(numel, n)
            start = r * base + min(r, extra)
            got = g.reducescatter(inputs[r], "max")
            want = inputs[-1][start : start + base + (1 if r < extra else 0)]
        else:
            g.barrier()
            continue
        _close(got, want, f"op {i}: {kind} of {numel}")
    g.close()
    return count


def test_a_random_mix_of_ops_stays_correct_on_3_ranks():
    assert run_workers(_random_ops_worker, np=3, args=(_prefix(), 300), timeout=300) == [300] * 3


# ---- mismatches ---------------------------------------------------------------------------


def _mismatch_worker(prefix: str) -> dict:
    g = _join(prefix)
    assert g is not None
    r = g.local_rank
    cases = {
        "shape": lambda: g.allreduce_(torch.zeros(10 + r * SLOT)),
        "dtype": lambda: g.allreduce_(torch.zeros(4, dtype=torch.float32 if r else torch.int32)),
        "op": lambda: g.allreduce_(torch.zeros(4), "sum" if r else "max"),
        "kind": lambda: g.barrier() if r else g.broadcast_(torch.zeros(4), 0),
        "root": lambda: g.broadcast_(torch.zeros(4), r),
        "gather_rows": lambda: g.allgather(torch.zeros(2, r + 1)),
    }
    out: dict[str, object] = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except CollectiveMismatchError as exc:
            out[name] = str(exc)
    x = torch.ones(3000)  # the group still works after every mismatch
    g.allreduce_(x)
    out["after"] = x[0].item()
    g.close()
    return out


def test_mismatched_collectives_raise_on_every_rank_and_the_group_survives():
    results = run_workers(_mismatch_worker, np=2, args=(_prefix(),), timeout=120)
    for res in results:
        assert res["after"] == 2.0
        for name in ("shape", "dtype", "op", "kind", "root", "gather_rows"):
            assert res[name] is not None, name
            assert "local rank 0:" in res[name] and "local rank 1:" in res[name]
    assert "shape=(10,)" in results[0]["shape"] and "dtype=torch.int32" in results[0]["dtype"]


# ---- fallback -----------------------------------------------------------------------------


def _fallback_worker(prefix: str, shm_dir: str | None, free: int | None) -> dict:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    logging.getLogger("ringtrain").addHandler(Keep(logging.DEBUG))
    logging.getLogger("ringtrain").setLevel(logging.DEBUG)
    if shm_dir is not None:
        ShmGroup.shm_dir = shm_dir
    if free is not None:
        ShmGroup.free_space = staticmethod(lambda path: free)
    g = _join(prefix, slot_bytes=4 << 20)  # 16 MiB for 2 ranks
    return {
        "group": g is not None,
        "warnings": [r.getMessage() for r in records if r.levelno >= logging.WARNING],
    }


@pytest.mark.parametrize(
    ("shm_dir", "free", "says"),
    [(None, 1 << 20, "has 1 MiB free"), ("/nonexistent-shm", None, "does not exist")],
    ids=["too_small", "missing"],
)
def test_no_room_in_dev_shm_falls_back_with_one_warning_naming_the_fix(shm_dir, free, says):
    prefix = _prefix()
    results = run_workers(_fallback_worker, np=2, args=(prefix, shm_dir, free), timeout=120)
    assert [res["group"] for res in results] == [False, False]
    assert results[1]["warnings"] == []
    (line,) = results[0]["warnings"]
    assert says in line and "--shm-size" in line and "RING_SHM=0" in line
    assert _segments(prefix) == []


def test_ring_shm_0_disables_the_group(monkeypatch):
    from torch.distributed import HashStore

    monkeypatch.setenv("RING_SHM", "0")
    assert not shm_enabled()
    assert ShmGroup.create(HashStore(), "p", 0, 2, timeout_s=1.0) is None
    monkeypatch.setenv("RING_SHM", "1")
    assert shm_enabled()


def test_a_single_local_rank_works_in_process():
    from torch.distributed import HashStore

    prefix = _prefix()
    g = ShmGroup.create(HashStore(), prefix, 0, 1, timeout_s=5.0, slot_bytes=SLOT)
    assert g is not None and _segments(prefix) == []
    x = torch.arange(5000.0)
    g.allreduce_(x, ReduceOp.Average, postscale=2.0)
    assert torch.equal(x, torch.arange(5000.0) * 2)
    assert torch.equal(g.allgather(torch.ones(2, 2)), torch.ones(2, 2))
    g.close()
    with pytest.raises(RingError, match="closed"):
        g.barrier()


# ---- failures -----------------------------------------------------------------------------


def _dying_worker(prefix: str, when: str, ranks: list[int] | None = None) -> dict:
    if when == "before_create" and int(os.environ["RING_RANK"]) == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    g = _join(prefix, timeout_s=30.0 if when != "before_create" else 3.0, ranks=ranks)
    assert g is not None
    x = torch.ones(5000)
    g.allreduce_(x)
    if g.local_rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # mid-run: rank 0 is already in the next op
    t0 = time.monotonic()
    try:
        g.allreduce_(x)
        return {"error": None}
    except RingError as exc:
        return {"error": str(exc), "after_s": time.monotonic() - t0}


@pytest.mark.parametrize("ranks", [None, [6, 7]])
def test_sigkilled_rank_fails_the_others_fast_and_leaves_no_segment(ranks):
    """Named as the user knows it: the job's rank where the group was told it (the
    engine and the ring backend tell it: on a second host, local rank 1 is not rank 1)."""
    prefix = _prefix()
    results = run_workers(
        _dying_worker, np=2, args=(prefix, "mid_run", ranks), timeout=120, return_exceptions=True
    )
    assert isinstance(results[1], WorkerError) and "ProcessExit" in str(results[1])
    if ranks is None:
        assert "lost local rank 1, pid" in results[0]["error"]
    else:
        error = results[0]["error"]
        assert "lost rank 7 (local rank 1 on this host), pid" in error, error
        assert "while rank 6 (local rank 0 on this host) waited" in error
        assert "rank 7's log says why it died" in error
    assert results[0]["after_s"] < 1.0
    assert _segments(prefix) == []


def test_rank_killed_before_mapping_leaves_no_segment():
    prefix = _prefix()
    results = run_workers(
        _dying_worker, np=2, args=(prefix, "before_create"), timeout=120, return_exceptions=True
    )
    assert isinstance(results[0], WorkerError) and "timed out" in str(results[0])
    assert _segments(prefix) == []


def _closing_worker(prefix: str) -> dict:
    g = _join(prefix)
    assert g is not None
    if g.local_rank == 1:
        g.close()
        time.sleep(2.0)  # alive: only the closed flag can tell rank 0
        return {}
    t0 = time.monotonic()
    with pytest.raises(RingError, match="local rank 1 closed the shared-memory group") as exc:
        g.barrier()
    after = time.monotonic() - t0
    with pytest.raises(RingError, match="broken by an earlier failure"):
        g.allreduce_(torch.ones(3))
    g.close()
    return {"after_s": after, "error": str(exc.value)}


def test_a_rank_that_closes_fails_the_waiting_ranks_fast():
    results = run_workers(_closing_worker, np=2, args=(_prefix(),), timeout=120)
    assert results[0]["after_s"] < 1.0, results[0]


def _idle_worker(prefix: str) -> dict:
    g = _join(prefix, timeout_s=1.5)
    assert g is not None
    if g.local_rank == 1:
        time.sleep(1.0)
    cpu0, t0 = time.process_time(), time.monotonic()
    g.barrier()
    waited: dict[str, object] = {
        "cpu_s": time.process_time() - cpu0,
        "wall_s": time.monotonic() - t0,
    }
    if g.local_rank == 1:
        time.sleep(3.0)  # alive but absent: rank 0's next wait ends at timeout_s
        return waited
    t0 = time.monotonic()
    try:
        g.barrier()
    except RingError as exc:
        waited["timeout"] = str(exc)
        waited["timeout_after_s"] = time.monotonic() - t0
    return waited


def test_idle_wait_does_not_spin_and_timeout_bounds_it():
    results = run_workers(_idle_worker, np=2, args=(_prefix(),), timeout=120)
    rank0 = results[0]
    assert rank0["wall_s"] > 0.8 and rank0["cpu_s"] < 0.2, rank0
    assert "timed out after" in rank0["timeout"] and "local ranks [1]" in rank0["timeout"]
    assert 1.4 < rank0["timeout_after_s"] < 3.0


# ---- units --------------------------------------------------------------------------------


def test_split_gives_64_byte_aligned_ranges_covering_everything():
    ranges = split_ranges(1000, 3, 16)
    assert ranges == [(0, 336), (336, 672), (672, 1000)]
    assert split_ranges(5, 4, 16) == [(0, 5), (5, 5), (5, 5), (5, 5)]


def test_resolve_accepts_ops_and_strings_and_names_the_fix():
    assert resolve("avg", torch.float32) == ReduceOp.Average
    assert resolve(ReduceOp.Max, torch.int8) == ReduceOp.Max
    with pytest.raises(ValueError, match="complex"):
        resolve("min", torch.complex64)
    with pytest.raises(ValueError, match="Adasum"):
        resolve(ReduceOp.Adasum, torch.float32)


def test_layout_rejects_unaligned_slots():
    with pytest.raises(ValueError, match="multiple of 64"):
        Layout(2, 5000)
    assert Layout(2, SLOT).data_offset % 4096 == 0
