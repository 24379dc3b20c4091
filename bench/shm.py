"""Shared-memory allreduce (``ringcore._shm.ShmGroup``) against raw Gloo, 2 local ranks, one run.

Allreduce (Sum, float32) of 4 KB .. 64 MB: the ShmGroup against
``torch.distributed.all_reduce`` over Gloo on 127.0.0.1, measured in the same run in
alternating rounds (these machines are noisy), median time per op on rank 0. Every
sample starts after the same barrier (the ShmGroup's, the cheaper one) so that both
sides start aligned; up to 1 MB a sample is a burst of 10 back-to-back ops (time / 10),
so that the skew with which the ranks leave the barrier does not dominate. Prints a table and writes bench/results/shm.json. Usage:
    python bench/shm.py [--np 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

from ringcore.testing import run_workers

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20]
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _reps(nbytes: int, quick: bool) -> int:
    base = 30 if nbytes <= 1 << 20 else 8 if nbytes <= 16 << 20 else 3
    return max(3, base // (3 if quick else 1))


def _time(fn, reps: int, burst: int, barrier) -> float:
    for _ in range(2):  # warm-up
        fn()
    samples = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        for _ in range(burst):
            fn()
        samples.append((time.perf_counter() - t0) / burst)
    return statistics.median(samples)


def _pair(raw, ours, reps: int, burst: int, barrier, rounds: int = 3) -> tuple[float, float]:
    r, o = [], []
    for _ in range(rounds):
        r.append(_time(raw, reps, burst, barrier))
        o.append(_time(ours, reps, burst, barrier))
    return statistics.median(r), statistics.median(o)


def _connect():
    """This rank's Gloo process group and ShmGroup, both over the job's store."""
    import datetime
    import os

    import torch.distributed as dist

    from ringcore._shm import ShmGroup

    store = dist.TCPStore(
        os.environ["RING_STORE_ADDR"],
        int(os.environ["RING_STORE_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=120),
    )
    rank, size = int(os.environ["RING_RANK"]), int(os.environ["RING_SIZE"])
    dist.init_process_group(
        "gloo", store=dist.PrefixStore("gloo", store), rank=rank, world_size=size
    )
    group = ShmGroup.create(dist.PrefixStore("shm", store), "bench", rank, size, timeout_s=60)
    if group is None:
        raise RuntimeError("no room in /dev/shm for the benchmark's segment")
    return dist, group


def _bench_worker(sizes: list[int], quick: bool):
    import torch

    torch.set_num_threads(1)
    dist, group = _connect()
    n = dist.get_world_size()
    check = torch.ones(1000)
    group.allreduce_(check)
    assert check[0].item() == n, "ShmGroup allreduce is wrong"
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        raw, ours = _pair(
            lambda x=x: dist.all_reduce(x),
            lambda x=x: group.allreduce_(x, "sum"),
            _reps(nbytes, quick),
            10 if nbytes <= 1 << 20 else 1,
            group.barrier,
        )
        rows.append({"op": "allreduce", "bytes": nbytes, "raw_s": raw, "ours_s": ours})
    rank = dist.get_rank()
    group.close()
    dist.destroy_process_group()
    return rows if rank == 0 else None


def _busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    started = time.monotonic()
    rows = run_workers(_bench_worker, np=args.np, args=(SIZES, args.quick), timeout=600)[0]
    print(
        f"{'allreduce':<12}{'gloo us':>12}{'shm us':>12}{'gloo GB/s':>11}{'shm GB/s':>10}{'speedup':>9}"
    )
    for r in rows:
        r["raw_busbw_gbs"] = _busbw(r["bytes"], r["raw_s"], args.np)
        r["ours_busbw_gbs"] = _busbw(r["bytes"], r["ours_s"], args.np)
        r["speedup"] = r["raw_s"] / r["ours_s"]
        print(
            f"{_human(r['bytes']):<12}{r['raw_s'] * 1e6:>12.1f}{r['ours_s'] * 1e6:>12.1f}"
            f"{r['raw_busbw_gbs']:>11.3f}{r['ours_busbw_gbs']:>10.3f}{r['speedup']:>9.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "shm.json"
    report = {
        "np": args.np,
        "machine": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "wall_s": round(time.monotonic() - started, 1),
        "raw": "torch.distributed.all_reduce over Gloo on 127.0.0.1",
        "ours": "ringcore._shm.ShmGroup.allreduce_ (1 MiB slots)",
        "note": "speedup = raw time / ours time; busbw = bytes/t * 2(n-1)/n; medians on rank 0.",
        "rows": rows,
    }
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
