"""Allreduce through the engine on one host: the shared-memory data plane against the
network path (``RING_SHM=0``) and raw Gloo, 2 local ranks.

Three peers, each ``Sum`` of float32 ones, 4 KB .. 256 MB (``--quick``: .. 16 MB):

- ``ours shm``: ``ringcore.torch.allreduce`` with the engine's default plan (one host:
  the ``ShmGroup`` carries the op; ``data_plane`` in the JSON shows it held one);
- ``ours net``: the same call with ``RING_SHM=0`` (the engine over Gloo);
- ``raw gloo``: ``torch.distributed.all_reduce`` on the engine's own Gloo group.

The engine picks its plan at ``init()``, so the two ``ours`` peers cannot share one
ring: the ranks run two phases (``RING_SHM=1``, then ``0`` after ``shutdown()``), each
measuring its ``ours`` peer against raw Gloo in the same rounds, peers swapped every
round (``_common.orders``). Raw Gloo, measured in both phases, is the anchor between
them (its two medians are in the JSON). Every sample starts after a Gloo barrier; up
to 1 MB a sample is a burst of 10 ops (time / 10). Each rank times itself; a round's
figure is its slowest rank's. Usage::

    python bench/shm.py [--np 2] [--quick] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

from ringcore.testing import run_workers

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]


def _burst(nbytes: int) -> int:
    return 10 if nbytes <= 1 << 20 else 1


def _phase(shm: str, sizes: list[int], rounds: int) -> dict[str, Any]:
    """One ``init()`` with ``RING_SHM=shm``: per size, per peer, this rank's seconds per
    op in every round, and whether every result was right."""
    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd

    os.environ["RING_SHM"] = shm
    hvd.init()
    ours = "ours shm" if shm == "1" else "ours net"
    n = hvd.size()
    peers = {
        ours: lambda x: hvd.allreduce(x, op=hvd.Sum),
        "raw gloo": lambda x: (dist.all_reduce(y := x.clone()), y)[1],
    }
    times: dict[int, dict[str, list[float]]] = {}
    right = True
    for nbytes in sizes:
        x = torch.ones(nbytes // 4)
        burst = _burst(nbytes)
        for fn in peers.values():  # warm-up, and the check
            right &= bool((fn(x) == n).all())
        times[nbytes] = {p: [] for p in peers}
        for order in _common.orders(list(peers), rounds):
            for peer in order:
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(burst):
                    peers[peer](x)
                times[nbytes][peer].append((time.perf_counter() - t0) / burst)
    plane = _common.data_plane()
    hvd.shutdown()
    return {"times": times, "right": right, "data_plane": plane}


def _bench_worker(sizes: list[int], rounds: int) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    return {"shm": _phase("1", sizes, rounds), "net": _phase("0", sizes, rounds)}


def _busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _rows(per_rank: list[dict], sizes: list[int], n: int) -> list[dict[str, Any]]:
    rows = []
    for nbytes in sizes:
        row: dict[str, Any] = {"op": "allreduce", "bytes": nbytes}
        for phase, ours in (("shm", "ours shm"), ("net", "ours net")):
            for peer in (ours, "raw gloo"):
                key = peer if peer != "raw gloo" else f"raw gloo ({phase} phase)"
                s = _common.summary(
                    _common.slowest([r[phase]["times"][nbytes][peer] for r in per_rank])
                )
                s["busbw_gbs"] = _busbw(nbytes, s["median"], n)
                row[key] = s
        rows.append(row)
    return rows


def _table(rows: list[dict]) -> dict[str, Any]:
    peers = ("ours shm", "ours net", "raw gloo (shm phase)")
    return _common.table(
        ["allreduce", *(f"{p} us" for p in peers), "shm GB/s", "shm vs net", "shm vs gloo"],
        [
            [
                _human(r["bytes"]),
                *(_common.spread(r[p], 1e6) for p in peers),
                f"{r['ours shm']['busbw_gbs']:.3f}",
                f"{r['ours net']['median'] / r['ours shm']['median']:.2f}x",
                f"{r['raw gloo (shm phase)']['median'] / r['ours shm']['median']:.2f}x",
            ]
            for r in rows
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--np", type=int, default=2)
    _common.add_common_args(parser)
    args = parser.parse_args()
    rounds = _common.check_rounds(args.rounds)
    env = _common.environment(("torch",))
    sizes = QUICK_SIZES if args.quick else SIZES
    per_rank = run_workers(_bench_worker, np=args.np, args=(sizes, rounds), timeout=1800)
    rows = _rows(per_rank, sizes, args.np)
    t = _table(rows)
    _common.print_table(t)
    held = [bool(r["shm"]["data_plane"]["shm"]) for r in per_rank]
    checks = [
        _common.check(
            "every peer's sum equals the number of ranks",
            all(r[p]["right"] for r in per_rank for p in ("shm", "net")),
        ),
        _common.check(
            "ours shm held a shared-memory group on every rank; ours net on none",
            all(held) and not any(r["net"]["data_plane"]["shm"] for r in per_rank),
            f"shm phase: {sum(held)} of {len(held)} ranks",
        ),
    ]
    small = rows[0]
    targets = [
        _common.target(
            "4 KB allreduce through the engine, shm faster than the network path (x)",
            small["ours net"]["median"] / small["ours shm"]["median"],
            1.0,
            lower_is_better=False,
            why_missed="the engine's own per-op cost (control path, cycle) dominates at 4 KB",
        )
    ]
    _common.print_verdicts(targets, checks)
    _common.write(
        "shm",
        args.out,
        env,
        {
            "np": args.np,
            "peers": {
                "ours shm": "ringcore.torch.allreduce, engine default plan (ShmGroup, 1 MiB slots)",
                "ours net": "ringcore.torch.allreduce with RING_SHM=0 (Gloo)",
                "raw gloo": "torch.distributed.all_reduce on the engine's Gloo group",
            },
            "method": "two phases (RING_SHM=1, then 0); raw Gloo in both; slowest rank per "
            "round; bursts of 10 up to 1 MB",
            "data_plane_per_rank": [r["shm"]["data_plane"] for r in per_rank],
            "rows": rows,
            "table": t,
            "targets": targets,
            "checks": checks,
        },
        quick=args.quick,
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
