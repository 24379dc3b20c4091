"""Collective benchmark: ringcore against raw torch.distributed Gloo, 2 ranks, one run.

Prints a table and writes bench/results/collectives.json. Ratios compare the two
measured in the same run (these machines are noisy). Usage:
    python bench/collectives.py [--np 2] [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import statistics
import time

from ringcore.testing import run_workers

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def _reps(nbytes: int, quick: bool) -> int:
    base = 50 if nbytes <= 1 << 20 else 10 if nbytes <= 16 << 20 else 4
    return max(3, base // (3 if quick else 1))


def _time(fn, reps: int, barrier) -> float:
    for _ in range(2):  # warm-up
        fn()
    samples = []
    for _ in range(reps):
        barrier()
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _bench_worker(sizes: list[int], quick: bool):
    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    n = hvd.size()
    rows = []
    for nbytes in sizes:
        x = torch.ones(nbytes // 4, dtype=torch.float32)
        reps = _reps(nbytes, quick)
        raw = _time(lambda x=x: dist.all_reduce(x), reps, dist.barrier)
        ours = _time(lambda x=x: hvd.allreduce_(x, op=hvd.Sum), reps, dist.barrier)
        rows.append({"op": "allreduce", "bytes": nbytes, "raw_s": raw, "ours_s": ours})
    x = torch.ones((16 << 20) // 4)
    out = [torch.empty_like(x) for _ in range(n)]
    rows.append({"op": "allgather", "bytes": 16 << 20,
                 "raw_s": _time(lambda: dist.all_gather(out, x), 5, dist.barrier),
                 "ours_s": _time(lambda: hvd.allgather(x), 5, dist.barrier)})
    rows.append({"op": "broadcast", "bytes": 16 << 20,
                 "raw_s": _time(lambda: dist.broadcast(x, 0), 5, dist.barrier),
                 "ours_s": _time(lambda: hvd.broadcast_(x, 0), 5, dist.barrier)})
    small = [torch.ones(1024) for _ in range(200 if quick else 1000)]
    raw_many = _time(lambda: [dist.all_reduce(t) for t in small], 3, dist.barrier)
    ours_many = _time(lambda: hvd.grouped_allreduce(small, op=hvd.Sum), 3, dist.barrier)
    rows.append({"op": f"{len(small)} x allreduce 4KB (ours: grouped)", "bytes": 4096 * len(small),
                 "raw_s": raw_many, "ours_s": ours_many})
    return rows if hvd.rank() == 0 else None


def _busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    args = parser.parse_args()
    sizes = SIZES[:4] if args.quick else SIZES
    rows = run_workers(_bench_worker, np=args.np, args=(sizes, args.quick), timeout=1200)[0]
    print(f"{'op':<38}{'bytes':>12}{'raw ms':>10}{'ours ms':>10}{'raw GB/s':>10}{'ours GB/s':>10}{'ours/raw':>10}")
    for r in rows:
        r["raw_busbw_gbs"] = _busbw(r["bytes"], r["raw_s"], args.np)
        r["ours_busbw_gbs"] = _busbw(r["bytes"], r["ours_s"], args.np)
        r["speed_ratio"] = r["raw_s"] / r["ours_s"]
        print(f"{r['op']:<38}{r['bytes']:>12}{r['raw_s'] * 1e3:>10.3f}{r['ours_s'] * 1e3:>10.3f}"
              f"{r['raw_busbw_gbs']:>10.3f}{r['ours_busbw_gbs']:>10.3f}{r['speed_ratio']:>10.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "collectives.json"
    report = {"np": args.np, "machine": platform.platform(), "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
              "note": "speed_ratio = raw time / ours time (>= 1 means ours is as fast or faster). "
                      "This is the synchronous first cut; the op engine (fusion, async) is issue 3.",
              "rows": rows}
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
