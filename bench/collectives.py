"""Collective benchmark: ringcore against raw Gloo and MPICH's shared memory, 2 ranks, one host.

The peers run in the same processes, so they see the same machine at the same moment:
under ``mpiexec`` (the mpich wheel's, in the venv) every rank runs ringcore
(``RING_BACKEND=gloo``, MPI only for the rendezvous), raw ``torch.distributed`` on the
same Gloo group, and ``mpi4py`` (MPICH, which moves data between the ranks of one host
through shared memory). Without mpiexec/mpi4py the MPICH peer is left out (recorded).

Rows: blocking allreduce 4 KB .. 256 MB (at 4 KB and 1 MB also unnamed, as most scripts
write it, and under a name never seen before); allgather and broadcast of 16 MB; 1,000 4 KB
allreduces (ours async against raw Gloo sequential, raw Gloo ``async_op=True``, raw Gloo
on one flattened buffer, MPICH sequential); a simulated backward (100 gradients of 40 KB
- 4 MB, rank 0 submitting in reverse order). Each row: ``--rounds`` rounds (>= 5), the
peers' order swapped every round, a round being a barrier (MPI's when there, else Gloo's)
and then ``reps`` back-to-back ops; every rank times its rounds, and a round's figure is
the slowest rank's. Medians with min-max. Every row checks that all peers return the same
output from the same integer-valued input. ``torch.set_num_threads(1)`` on every rank.

Targets (issue 21) are in the JSON with the reason of every miss. Usage:
    python bench/collectives.py [--np 2] [--rounds 5] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import _common

SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20, 64 << 20, 256 << 20]
QUICK_SIZES = [4 << 10, 64 << 10, 1 << 20, 16 << 20]
BIG = 16 << 20  # allgather, broadcast
#: sizes also timed unnamed and under a name never seen before (issue 40)
UNNAMED_SIZES = (4 << 10, 1 << 20)


def _reps(nbytes: int, quick: bool) -> int:
    if nbytes <= 1 << 20:
        return 10 if quick else 50
    if nbytes <= 16 << 20:
        return 2 if quick else 10
    return 4 if nbytes <= 64 << 20 else 2


def _grad_sizes(quick: bool) -> list[int]:
    count = 30 if quick else 100
    return [int(10_000 * (100 ** (i / (count - 1)))) for i in range(count)]  # 40 KB .. 4 MB


# --- on every rank -------------------------------------------------------------------


class _Rank:
    """This rank's three data planes and one barrier shared by every peer."""

    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        import ringcore.torch as hvd

        torch.set_num_threads(1)
        hvd.init()
        self.torch, self.dist, self.hvd = torch, dist, hvd
        self.rank, self.size = hvd.rank(), hvd.size()
        self.comm = None
        if os.environ.get("BENCH_MPI") == "1":
            from mpi4py import MPI

            self.mpi, self.comm = MPI, MPI.COMM_WORLD
        self.barrier = self.comm.Barrier if self.comm is not None else dist.barrier

    def time(self, peers: dict[str, Any], reps: int, rounds: int) -> dict[str, list[float]]:
        """Seconds per op of every peer in every round, on this rank (orders swapped)."""
        for fn in peers.values():  # warm-up: connections, buffers, the response cache
            fn()
            fn()
        out: dict[str, list[float]] = {name: [] for name in peers}
        for order in _common.orders(list(peers), rounds):
            for name in order:
                fn = peers[name]
                self.barrier()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                out[name].append((time.perf_counter() - t0) / reps)
        return out


def _same(outputs: dict[str, Any]) -> tuple[bool, str]:
    import torch

    names = list(outputs)
    ref = outputs[names[0]]
    bad = [n for n in names[1:] if not torch.equal(torch.as_tensor(outputs[n]), ref)]
    return not bad, (f"differs from {names[0]}: {bad}" if bad else f"{len(names)} peers equal")


def _allreduce_row(r: _Rank, nbytes: int, reps: int, rounds: int) -> dict[str, Any]:
    torch, dist, hvd = r.torch, r.dist, r.hvd
    n = nbytes // 4
    x = torch.zeros(n)  # zeros: a sum of zeros stays finite however many reps
    peers: dict[str, Any] = {
        "ours": lambda: hvd.allreduce_(x, op=hvd.Sum, name=f"ar.{nbytes}"),
        "gloo": lambda: dist.all_reduce(x),
    }
    if nbytes in UNNAMED_SIZES:  # as most scripts write it: no name (a counter names it)
        fresh = itertools.count()
        peers["ours_unnamed"] = lambda: hvd.allreduce_(x, op=hvd.Sum)
        peers["ours_first_seen"] = lambda: hvd.allreduce_(
            x, op=hvd.Sum, name=f"fresh.{nbytes}.{next(fresh)}"
        )
    if r.comm is not None:
        xn = x.numpy()
        peers["mpich"] = lambda: r.comm.Allreduce(r.mpi.IN_PLACE, xn)
    times = r.time(peers, reps, rounds)
    inp = (torch.arange(n) % 13 + r.rank).float()
    outs = {"ours": hvd.allreduce(inp.clone(), op=hvd.Sum, name=f"check.{nbytes}")}
    g = inp.clone()
    dist.all_reduce(g)
    outs["gloo"] = g
    if r.comm is not None:
        m = inp.clone().numpy()
        r.comm.Allreduce(r.mpi.IN_PLACE, m)
        outs["mpich"] = torch.from_numpy(m)
    passed, detail = _same(outs)
    return {"op": "allreduce", "bytes": nbytes, "times": times, "check": [passed, detail]}


def _allgather_row(r: _Rank, reps: int, rounds: int) -> dict[str, Any]:
    torch, dist, hvd = r.torch, r.dist, r.hvd
    n = BIG // 4
    x = torch.zeros(n)
    parts = [torch.empty_like(x) for _ in range(r.size)]
    peers: dict[str, Any] = {
        "ours": lambda: hvd.allgather(x, name="ag"),
        "gloo": lambda: dist.all_gather(parts, x),
    }
    if r.comm is not None:
        xn, recv = x.numpy(), torch.empty(n * r.size).numpy()
        peers["mpich"] = lambda: r.comm.Allgather(xn, recv)
    times = r.time(peers, reps, rounds)
    inp = torch.arange(n).float() % 11 + r.rank
    outs = {"ours": hvd.allgather(inp, name="ag.check")}
    dist.all_gather(parts, inp)
    outs["gloo"] = torch.cat(parts)
    if r.comm is not None:
        recv = torch.empty(n * r.size)
        r.comm.Allgather(inp.numpy(), recv.numpy())
        outs["mpich"] = recv
    passed, detail = _same(outs)
    return {"op": "allgather", "bytes": BIG, "times": times, "check": [passed, detail]}


def _broadcast_row(r: _Rank, reps: int, rounds: int) -> dict[str, Any]:
    torch, dist, hvd = r.torch, r.dist, r.hvd
    n = BIG // 4
    x = torch.zeros(n)
    peers: dict[str, Any] = {
        "ours": lambda: hvd.broadcast_(x, 0, name="bc"),
        "gloo": lambda: dist.broadcast(x, 0),
    }
    if r.comm is not None:
        xn = x.numpy()
        peers["mpich"] = lambda: r.comm.Bcast(xn, 0)
    times = r.time(peers, reps, rounds)

    def fresh():
        return torch.arange(n).float() % 7 + r.rank

    outs = {"ours": hvd.broadcast_(fresh(), 0, name="bc.check")}
    g = fresh()
    dist.broadcast(g, 0)
    outs["gloo"] = g
    if r.comm is not None:
        m = fresh()
        r.comm.Bcast(m.numpy(), 0)
        outs["mpich"] = m
    passed, detail = _same(outs)
    return {"op": "broadcast", "bytes": BIG, "times": times, "check": [passed, detail]}


def _many(r: _Rank, tensors: list, order: list[int], tag: str) -> dict[str, Any]:
    """The peers of a burst of allreduces: ours async, raw Gloo sequential / async_op /
    flattened into one buffer (flatten and copy-back included), MPICH sequential."""
    dist, hvd, torch = r.dist, r.hvd, r.torch

    def ours():
        handles = [hvd.allreduce_async_(tensors[i], name=f"{tag}.{i}", op=hvd.Sum) for i in order]
        for h in handles:
            hvd.synchronize(h)

    def sequential():
        for t in tensors:
            dist.all_reduce(t)

    def async_op():
        for w in [dist.all_reduce(t, async_op=True) for t in tensors]:
            w.wait()

    def flat():
        buf = torch.cat([t.reshape(-1) for t in tensors])
        dist.all_reduce(buf)
        offset = 0
        for t in tensors:
            t.copy_(buf[offset : offset + t.numel()].view_as(t))
            offset += t.numel()

    peers: dict[str, Any] = {
        "ours": ours,
        "gloo": sequential,
        "gloo_async_op": async_op,
        "gloo_flat": flat,
    }
    if r.comm is not None:
        arrays = [t.numpy() for t in tensors]

        def mpich():
            for a in arrays:
                r.comm.Allreduce(r.mpi.IN_PLACE, a)

        peers["mpich"] = mpich
    return peers


def _burst_row(
    r: _Rank, op: str, sizes: list[int], reverse_on_0: bool, rounds: int
) -> dict[str, Any]:
    torch = r.torch
    order = list(range(len(sizes)))
    if reverse_on_0 and r.rank == 0:
        order.reverse()  # ranks submit in different orders: the engine must agree on one
    tensors = [torch.zeros(n) for n in sizes]
    peers = _many(r, tensors, order, op.split()[0])
    times = r.time(peers, 1, rounds)
    outs = {}
    for name, fn in peers.items():
        for i, t in enumerate(tensors):
            t.fill_(float(i % 7 + r.rank))
        fn()
        outs[name] = torch.cat([t.reshape(-1) for t in tensors])
    passed, detail = _same(outs)
    return {
        "op": op,
        "bytes": 4 * sum(sizes),
        "count": len(sizes),
        "times": times,
        "check": [passed, detail],
    }


def measure(params: dict[str, Any]) -> dict[str, Any]:
    """Every row on this rank; the rank's own times (the parent takes the slowest)."""
    r = _Rank()
    rounds, quick = params["rounds"], params["quick"]
    rows = [_allreduce_row(r, s, _reps(s, quick), rounds) for s in params["sizes"]]
    rows.append(_allgather_row(r, 2 if quick else 5, rounds))
    rows.append(_broadcast_row(r, 2 if quick else 5, rounds))
    small = params["small"]
    rows.append(_burst_row(r, f"{small} x allreduce 4KB", [1024] * small, False, rounds))
    grads = _grad_sizes(quick)
    rows.append(_burst_row(r, f"backward: {len(grads)} grads 40KB-4MB", grads, True, rounds))
    r.barrier()
    result = {
        "rank": r.rank,
        "size": r.size,
        "mpi": r.comm is not None,
        "data_plane": _common.data_plane(),
        "rows": rows,
    }
    r.hvd.shutdown()
    return result


def _mpi_worker(params_path: str, out_prefix: str) -> None:
    params = json.loads(pathlib.Path(params_path).read_text())
    result = measure(params)
    pathlib.Path(f"{out_prefix}.{result['rank']}.json").write_text(json.dumps(result))


# --- on the driver -------------------------------------------------------------------


def _mpiexec() -> str | None:
    """The mpiexec beside this interpreter (the mpich wheel's), if mpi4py imports too."""
    candidate = pathlib.Path(sys.executable).with_name("mpiexec")
    path = str(candidate) if candidate.exists() else shutil.which("mpiexec")
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        return None
    return path


def _run(params: dict[str, Any], np: int, timeout: float) -> tuple[list[dict], str]:
    mpiexec = _mpiexec()
    if mpiexec is None:
        from ringcore.testing import run_workers

        return run_workers(measure, np=np, args=(params,), timeout=timeout), "run_workers"
    with tempfile.TemporaryDirectory(prefix="bench-collectives-") as tmp:
        params_path = pathlib.Path(tmp, "params.json")
        params_path.write_text(json.dumps(params))
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
        if "RING_SHM" in os.environ:
            env["RING_SHM"] = os.environ["RING_SHM"]
        env.update(RING_BACKEND="gloo", BENCH_MPI="1", OMP_NUM_THREADS="1")
        cmd = [mpiexec, "-n", str(np), sys.executable, __file__, "--mpi-worker"]
        proc = subprocess.run(
            [*cmd, str(params_path), f"{tmp}/rank"],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise RuntimeError(
                f"mpiexec -n {np} bench/collectives.py exited {proc.returncode}: "
                f"{proc.stderr[-3000:]}"
            )
        results = [json.loads(pathlib.Path(f"{tmp}/rank.{i}.json").read_text()) for i in range(np)]
    return results, f"mpiexec ({mpiexec})"


def _busbw(nbytes: int, seconds: float, n: int) -> float:
    return nbytes / seconds * 2 * (n - 1) / n / 1e9


def _merge(per_rank: list[dict], np: int) -> list[dict[str, Any]]:
    """One row per op: per peer the slowest rank's time per round, summarised."""
    rows = []
    for i, first in enumerate(per_rank[0]["rows"]):
        peers = {}
        for name in first["times"]:
            rounds = _common.slowest([rank["rows"][i]["times"][name] for rank in per_rank])
            s = _common.summary(rounds)
            peers[name] = {
                "seconds_per_op": s,
                "busbw_gbs_median": _busbw(first["bytes"], s["median"], np),
                "per_rank": [rank["rows"][i]["times"][name] for rank in per_rank],
            }
        checks = [rank["rows"][i]["check"] for rank in per_rank]
        rows.append(
            {
                "op": first["op"],
                "bytes": first["bytes"],
                **({"count": first["count"]} if "count" in first else {}),
                "peers": peers,
                "check": _common.check(
                    f"{first['op']} {_human(first['bytes'])}: every peer's output equal",
                    all(c[0] for c in checks),
                    "; ".join(f"rank {k}: {c[1]}" for k, c in enumerate(checks)),
                ),
            }
        )
    return rows


def _human(nbytes: int) -> str:
    return f"{nbytes >> 20} MB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KB"


def _med(row: dict, peer: str) -> float | None:
    p = row["peers"].get(peer)
    return None if p is None else p["seconds_per_op"]["median"]


def _bw(row: dict | None, peer: str) -> float | None:
    return row["peers"][peer]["busbw_gbs_median"] if row and peer in row["peers"] else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else a / b


def _plane_text(planes: list[dict[str, Any]], shm_env: str | None) -> str:
    """What carried ours' bytes, for the reasons of missed targets."""
    if any(p["shm"] for p in planes):
        return (
            f"ours ran on the shared-memory plane ({planes[0]['mode']}, ops per path "
            f"{planes[0]['ops']}; RING_SHM={shm_env!r})"
        )
    return (
        f"ours held no shared-memory group (RING_SHM={shm_env!r}; backend "
        f"{planes[0]['backend']!r}): the engine moves every byte through the same Gloo call "
        "the raw peer makes"
    )


HOROVOD_1000_MS = 24.6  # issue 21: Horovod's time for 1,000 async 4 KB allreduces, 2 ranks


def _ms(row: dict | None, peer: str) -> str:
    t = _med(row, peer) if row else None
    return "-" if t is None else f"{t * 1e3:.3g} ms"


def _targets(rows: list[dict], plane: str, shm: bool, quick: bool) -> list[dict[str, Any]]:
    """Issue 21's targets for 2 ranks on one host, each met, missed with why, or not measured.

    ``plane`` says what carried ours' bytes; ``shm``: whether it was a shared-memory group
    (the reasons differ: without one, ours is raw Gloo plus the engine's cost)."""
    by = {(r["op"], r["bytes"]): r for r in rows}
    out = []
    small = by.get(("allreduce", 4 << 10))
    ours = _med(small, "ours") if small else None
    per_op = (
        "a repeated blocking op takes the fast lane (no coordinator: the ranks vote through "
        "the shared segment and each runs it in its own thread), so the rest is the "
        "caller's Python per op (request, handle, vote) around the shared-memory rounds"
    )
    out.append(
        _common.target(
            "4 KB blocking allreduce time <= 0.25x raw Gloo",
            _ratio(ours, _med(small, "gloo")) if small else None,
            0.25,
            lower_is_better=True,
            why_missed=f"ours {_ms(small, 'ours')} vs raw Gloo {_ms(small, 'gloo')}: {plane}; "
            + (
                per_op
                if shm
                else "ours adds a negotiation round trip to rank 0's coordinator to the same "
                "call, so it cannot be faster than raw Gloo"
            )
            + ".",
        )
    )
    for size in UNNAMED_SIZES:
        row = by.get(("allreduce", size))
        for peer, what in (("ours_unnamed", "unnamed"), ("ours_first_seen", "first-seen name")):
            out.append(
                _common.target(
                    f"{_human(size)} blocking allreduce, {what}, time <= 0.5x raw Gloo",
                    _ratio(_med(row, peer), _med(row, "gloo")) if row else None,
                    0.5,
                    lower_is_better=True,
                    why_missed=f"ours {_ms(row, peer)} vs raw Gloo {_ms(row, 'gloo')}: {plane}; "
                    + (
                        "a name the coordinator has not cached takes the fast lane too (the "
                        "ranks vote on a digest of the whole request), so the rest is the "
                        "caller's Python per op"
                        if shm
                        else "without a shared-memory group every new name is negotiated "
                        "with rank 0's coordinator over TCP before the raw call"
                    )
                    + ".",
                    note="" if row else "not measured",
                )
            )
    out.append(
        _common.target(
            "4 KB blocking allreduce time <= 20x MPICH shm",
            _ratio(ours, _med(small, "mpich")) if small else None,
            20.0,
            lower_is_better=True,
            why_missed=f"ours {_ms(small, 'ours')} vs MPICH {_ms(small, 'mpich')}: MPICH copies "
            f"through shared memory and spins (µs per op); {plane}; {per_op}.",
            note="" if small and _med(small, "mpich") else "no MPICH peer (mpiexec/mpi4py missing)",
        )
    )
    for size in (16 << 20, 256 << 20):
        row = by.get(("allreduce", size))
        missing = "not in --quick (sizes up to 16 MB)" if quick else "not measured"
        out.append(
            _common.target(
                f"{_human(size)} allreduce bus bandwidth >= 2.5x raw Gloo",
                _ratio(_bw(row, "ours"), _bw(row, "gloo")),
                2.5,
                lower_is_better=False,
                why_missed=f"{plane}"
                + (
                    "; at this size the copies into and out of the segment bound it: ours "
                    f"reaches {_ratio(_bw(row, 'ours'), _bw(row, 'mpich')) or 0:.2f}x MPICH's "
                    "shared memory (the near-limit reference) in this run, so the machine's "
                    "memory bandwidth, not the method, sets the ratio to Gloo"
                    if shm
                    else ": at this size ours is the raw call plus a negotiation, so the "
                    "ratio is at most ~1"
                )
                + ".",
                note="" if row else missing,
            )
        )
        out.append(
            _common.target(
                f"{_human(size)} allreduce bus bandwidth >= 0.7x MPICH shm",
                _ratio(_bw(row, "ours"), _bw(row, "mpich")),
                0.7,
                lower_is_better=False,
                why_missed=f"{plane}"
                + (
                    "; the reduction runs in torch ops from Python, MPICH's in C"
                    if shm
                    else "; Gloo over loopback TCP copies each byte through the kernel's "
                    "socket buffers, MPICH's shared memory does not"
                )
                + ".",
                note="" if row and _bw(row, "mpich") else missing if not row else "no MPICH peer",
            )
        )
    burst = next((r for r in rows if r["op"].endswith("x allreduce 4KB")), None)
    out.append(
        _common.target(
            "1,000 async 4 KB allreduces time <= 0.025x raw sequential Gloo",
            _ratio(_med(burst, "ours"), _med(burst, "gloo")) if burst else None,
            0.025,
            lower_is_better=True,
            why_missed=f"ours {_ms(burst, 'ours')} per burst vs raw Gloo sequential "
            f"{_ms(burst, 'gloo')}, async_op {_ms(burst, 'gloo_async_op')}, one flat buffer "
            f"{_ms(burst, 'gloo_flat')}: the burst runs as one fused batch (in the fast lane "
            "on one host), but every submission costs tens of µs of Python (request, handle, "
            "the engine's queue), which Horovod does in C++.",
            note=f"--quick: {burst['count']} ops, not 1,000" if burst and quick else "",
        )
    )
    burst_ms = _med(burst, "ours") * 1e3 if burst else None
    out.append(
        _common.target(
            f"1,000 async 4 KB allreduces time <= Horovod's {HOROVOD_1000_MS} ms",
            burst_ms if burst and not quick else None,
            HOROVOD_1000_MS,
            lower_is_better=True,
            why_missed=f"ours {_ms(burst, 'ours')}: per-submission Python cost (see the "
            "target above); Horovod submits from C++",
            note="--quick runs fewer than 1,000 ops" if quick else "",
        )
    )
    return out


def _table(rows: list[dict]) -> dict[str, Any]:
    lines = []
    for r in rows:
        ours = _med(r, "ours")
        for name, p in r["peers"].items():
            s = p["seconds_per_op"]
            lines.append(
                [
                    f"{r['op']} {_human(r['bytes'])}",
                    name,
                    _common.spread(s, 1e3),
                    f"{p['busbw_gbs_median']:.3g}" if r["op"] == "allreduce" else "",
                    "" if name == "ours" else f"{ours / s['median']:.3g}",
                ]
            )
    return _common.table(
        ["op", "peer", "ms per op, median (min-max)", "busbw GB/s", "ours time / peer's"], lines
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument(
        "--mpi-worker", nargs=2, metavar=("PARAMS", "OUT_PREFIX"), help=argparse.SUPPRESS
    )
    _common.add_common_args(parser)
    args = parser.parse_args()
    if args.mpi_worker:
        _mpi_worker(*args.mpi_worker)
        return
    rounds = _common.check_rounds(args.rounds)
    env = _common.environment(("torch", "mpi4py", "mpich"))
    params = {
        "sizes": QUICK_SIZES if args.quick else SIZES,
        "rounds": rounds,
        "quick": args.quick,
        "small": 200 if args.quick else 1000,
    }
    per_rank, launcher = _run(params, args.np, 300 if args.quick else 3600)
    rows = _merge(per_rank, args.np)
    planes = [rank["data_plane"] for rank in per_rank]
    shm = any(p["shm"] for p in planes)
    targets = _targets(rows, _plane_text(planes, os.environ.get("RING_SHM")), shm, args.quick)
    checks = [r["check"] for r in rows]
    t = _table(rows)
    _common.print_table(t)
    _common.print_verdicts(targets, checks)
    _common.write(
        "collectives",
        args.out,
        env,
        {
            "np": args.np,
            "launcher": launcher,
            "mpich_peer": per_rank[0]["mpi"],
            "data_plane_per_rank": planes,
            "threads": "torch.set_num_threads(1) on every rank (the same process runs every peer)",
            "barrier": "MPI_Barrier before every round" if per_rank[0]["mpi"] else "Gloo barrier",
            "peers": {
                "ours": "ringcore.torch (allreduce_ / allgather / broadcast_ blocking; "
                "allreduce_async_ + synchronize for the bursts)",
                "gloo": "torch.distributed on ringcore's Gloo group, blocking, one call per op",
                "gloo_async_op": "the burst as dist.all_reduce(async_op=True), then wait() each",
                "gloo_flat": "the burst concatenated into one buffer, one all_reduce, copied back",
                "mpich": "mpi4py on MPICH (shared memory between the ranks of one host)",
            },
            "note": "time per op (a burst row: per burst); busbw = bytes/t * 2(n-1)/n on the "
            "median; a round's figure is its slowest rank's",
            "targets": targets,
            "checks": checks,
            "table": t,
            "rows": rows,
        },
        quick=args.quick,
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
