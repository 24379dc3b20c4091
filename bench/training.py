"""Training benchmark: ringcore.torch.DistributedOptimizer against DDP (default and tuned),
2 ranks on one host, same model, initial weights, per-rank data and batch.

Every peer lives in the same 2 processes (``torch.set_num_threads(1)`` on each), so all
see the same machine at the same moment: ours (``DistributedOptimizer`` over ringcore's
Gloo group); DDP with its defaults; DDP tuned as a competent user would
(``gradient_as_bucket_view=True``, ``static_graph=True``, and the ``bucket_cap_mb`` of a
small grid that ran fastest here, picked on the slowest rank); and "no-comm", each rank
training alone at the same time (what the two ranks would reach without communication:
the scaling bound of this host). DDP runs on its own Gloo group (``dist.new_group``).

Each of ``--rounds`` rounds (>= 5, the peers' order swapped every round) starts every
peer from the same initial weights and times ``--steps`` SGD steps on every rank; the
round's figure is the slowest rank's. After each round the final weights of ours and
both DDPs must agree (``allclose``) on every rank, and each peer's weights must be equal
across ranks: both checks are in the JSON. Targets: ours >= 1.2x DDP samples/s (issue 21); ours >= 0.85x
(MLP) and 0.95x (convnet) the samples/s of the ranks alone (issue 40), with the floor that
bounds it: the least memory traffic of averaging a step's gradients (``_floor``).
Usage: python bench/training.py [--steps 20] [--rounds 5] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common

from ringcore.testing import run_workers

PEERS = ("ours", "ddp", "ddp_tuned", "no_comm")
DIST_PEERS = ("ours", "ddp", "ddp_tuned")
TRAINING_GOAL = 1.2  # issue 21: ours >= 1.2x each DDP's samples/s
SCALING_GOAL = {"mlp": 0.85, "convnet": 0.95}  # issue 40: ours >= this x no_comm samples/s
RTOL, ATOL = 1e-4, 1e-6


def _build(kind: str, quick: bool, rank: int):
    """The model (seeded: the same on every rank) and this rank's own batch."""
    import torch

    torch.manual_seed(0)
    width = 256 if quick else 2048
    batch = 16 if quick else 64
    if kind == "mlp":  # ~10 M parameters (quick: ~0.27 M)
        layers: list[torch.nn.Module] = [torch.nn.Linear(784, width), torch.nn.ReLU()]
        for _ in range(1 if quick else 2):
            layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(width, 10))
        shape: tuple[int, ...] = (batch, 784)
    else:  # a small conv net on 32x32 images
        c1, c2 = (8, 16) if quick else (32, 64)
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, c1, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(c1, c2, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(c2 * 8 * 8, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        )
        shape = (batch, 3, 32, 32)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(*shape, generator=gen)
    y = torch.randint(0, 10, (batch,), generator=gen)
    return model, x, y


class _Peer:
    """One way of training: a model, its optimizer, and a reset to the initial weights."""

    def __init__(self, model, opt, init: list) -> None:
        self.model, self.opt, self.init = model, opt, init

    def reset(self) -> None:
        import torch

        with torch.no_grad():
            for p, p0 in zip(self.params(), self.init):
                p.copy_(p0)
        self.opt.zero_grad()

    def params(self) -> list:
        module = getattr(self.model, "module", self.model)
        return list(module.parameters())

    def steps(self, x, y, n: int) -> float:
        import torch

        loss = torch.tensor(0.0)
        for _ in range(n):
            self.opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(self.model(x), y)
            loss.backward()
            self.opt.step()
        return float(loss.detach())

    def flat(self):
        import torch

        return torch.cat([p.detach().reshape(-1) for p in self.params()]).clone()


def _ddp(kind, quick, rank, init, group, **options):
    import torch

    model = _build(kind, quick, rank)[0]
    ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group, **options)
    return _Peer(ddp, torch.optim.SGD(ddp.parameters(), lr=0.01), init)


def _pick_bucket(kind, quick, rank, init, group, x, y, dist) -> tuple[float, dict]:
    """The bucket_cap_mb of the grid whose 3 steps ran fastest on the slowest rank."""
    import torch

    grid = (25.0,) if quick else (5.0, 25.0, 100.0)
    times = {}
    for mb in grid:
        peer = _ddp(
            kind,
            quick,
            rank,
            init,
            group,
            bucket_cap_mb=mb,
            gradient_as_bucket_view=True,
            static_graph=True,
        )
        peer.steps(x, y, 2)
        dist.barrier(group)
        t0 = time.perf_counter()
        peer.steps(x, y, 3)
        slowest = torch.tensor([time.perf_counter() - t0])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
        times[mb] = slowest.item() / 3
    best = min(times, key=times.get)
    return best, {str(k): v for k, v in times.items()}


def _worker(kind: str, steps: int, rounds: int, quick: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    group = dist.new_group(backend="gloo")  # DDP's own Gloo group
    model, x, y = _build(kind, quick, rank)
    init = [p.detach().clone() for p in model.parameters()]
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    bucket, grid = _pick_bucket(kind, quick, rank, init, group, x, y, dist)
    plain = _build(kind, quick, rank)[0]
    peers = {
        "ours": _Peer(model, opt, init),
        "ddp": _ddp(kind, quick, rank, init, group),
        "ddp_tuned": _ddp(
            kind,
            quick,
            rank,
            init,
            group,
            bucket_cap_mb=bucket,
            gradient_as_bucket_view=True,
            static_graph=True,
        ),
        "no_comm": _Peer(plain, torch.optim.SGD(plain.parameters(), lr=0.01), init),
    }
    for peer in peers.values():  # warm-up: buffers, buckets, the response cache
        peer.steps(x, y, 3)
    times: dict[str, list[float]] = {name: [] for name in peers}
    loss: dict[str, list[float]] = {name: [] for name in peers}
    diffs: list[dict[str, float]] = []
    sums: dict[str, list[float]] = {name: [] for name in DIST_PEERS}
    for order in _common.orders(list(peers), rounds):
        final = {}
        for name in order:
            peer = peers[name]
            peer.reset()
            dist.barrier(group)
            t0 = time.perf_counter()
            loss[name].append(peer.steps(x, y, steps))
            times[name].append(time.perf_counter() - t0)
            final[name] = peer.flat()
        ref = final["ours"]
        diffs.append({n: (final[n] - ref).abs().max().item() for n in ("ddp", "ddp_tuned")})
        for n in DIST_PEERS:
            sums[n].append(final[n].double().abs().sum().item())
        allclose = all(
            torch.allclose(final[n], ref, rtol=RTOL, atol=ATOL) for n in ("ddp", "ddp_tuned")
        )
        diffs[-1]["allclose"] = float(allclose)
    plane = _common.data_plane()
    floor = _floor(model, rounds, lambda: dist.barrier(group))
    hvd.shutdown()
    return {
        "rank": rank,
        "data_plane": plane,
        "floor_s": floor,
        "times": times,
        "loss": loss,
        "diffs": diffs,
        "checksums": sums,
        "bucket_cap_mb": bucket,
        "bucket_grid_s_per_step": grid,
        "batch": len(y),
        "parameters": sum(p.numel() for p in init),
    }


def _floor(model, rounds: int, barrier) -> list[float]:
    """Seconds, per round, of the least memory traffic an allreduce of this step's
    gradients costs a rank when backward did not write them into shared memory (issue 40's
    bound): copy them into one flat buffer (the segment), add the peer's half of its
    buffer into this rank's half (the reduction), copy the peer's reduced half back (this
    rank's half stays where it is: the gradients as views of the buffer). Plain local
    memory, both ranks at once after a barrier, so they share the memory bus as they would;
    no barrier inside, no Python per op: below what any real allreduce can reach."""
    import torch

    grads = [p.grad.detach().clone() for p in model.parameters()]
    n = sum(g.numel() for g in grads)
    mine, peer = torch.empty(n), torch.randn(n)
    views, at = [], 0
    for g in grads:
        views.append(mine[at : at + g.numel()].view_as(g))
        at += g.numel()
    half = n // 2
    out = []
    for i in range(rounds + 1):
        barrier()
        t0 = time.perf_counter()
        torch._foreach_copy_(views, grads)
        mine[:half].add_(peer[:half])
        mine[half:].copy_(peer[half:])
        if i:  # the first: warm-up
            out.append(time.perf_counter() - t0)
    return out


def _row(kind: str, per_rank: list[dict], steps: int) -> tuple[dict, list[dict]]:
    n = len(per_rank)
    batch = per_rank[0]["batch"]
    peers = {}
    for name in PEERS:
        rounds = _common.slowest([r["times"][name] for r in per_rank])
        # no_comm: each rank trains alone, so its samples/s is the sum over ranks' batches too
        rates = [n * batch * steps / t for t in rounds]
        peers[name] = {
            "step_s": _common.summary(t / steps for t in rounds),
            "samples_per_s": _common.summary(rates),
            "final_loss_rank0": per_rank[0]["loss"][name],
        }
    worst = {k: max(d[k] for r in per_rank for d in r["diffs"]) for k in ("ddp", "ddp_tuned")}
    same = all(d["allclose"] for r in per_rank for d in r["diffs"])
    across = {
        name: max(
            abs(a - b) / max(abs(a), 1e-12)
            for a, b in zip(*(r["checksums"][name] for r in per_rank))
        )
        for name in DIST_PEERS
    }
    checks = [
        _common.check(
            f"{kind}: final weights of ours, DDP and tuned DDP allclose (rtol {RTOL}, atol {ATOL}) "
            "on every rank, every round",
            same,
            f"max |ours - ddp| {worst['ddp']:.3g}, |ours - ddp_tuned| {worst['ddp_tuned']:.3g}",
        ),
        _common.check(
            f"{kind}: each peer's weights equal across ranks (relative checksum difference <= 1e-6)",
            all(v <= 1e-6 for v in across.values()),
            ", ".join(f"{k} {v:.2g}" for k, v in across.items()),
        ),
    ]
    ours = peers["ours"]["samples_per_s"]["median"]
    floor = _common.summary(_common.slowest([r["floor_s"] for r in per_rank]))
    alone = peers["no_comm"]["step_s"]["median"]
    row = {
        "model": kind,
        "parameters": per_rank[0]["parameters"],
        "per_rank_batch": batch,
        "steps_per_round": steps,
        "ours_data_plane_per_rank": [r["data_plane"] for r in per_rank],
        "ddp_tuned_bucket_cap_mb": per_rank[0]["bucket_cap_mb"],
        "ddp_bucket_grid_s_per_step": per_rank[0]["bucket_grid_s_per_step"],
        "peers": peers,
        "ours_vs_ddp": ours / peers["ddp"]["samples_per_s"]["median"],
        "ours_vs_ddp_tuned": ours / peers["ddp_tuned"]["samples_per_s"]["median"],
        "ours_scaling_vs_no_comm": ours / peers["no_comm"]["samples_per_s"]["median"],
        "ddp_tuned_scaling_vs_no_comm": peers["ddp_tuned"]["samples_per_s"]["median"]
        / peers["no_comm"]["samples_per_s"]["median"],
        "gradient_floor_s": floor,
        "floor_bound_vs_no_comm": alone / (alone + floor["median"]),
    }
    return row, checks


def _why(row: dict, base: str, goal: float) -> str:
    """The reason of a missed training target, from what this run measured."""
    peers = row["peers"]
    bound = peers["no_comm"]["samples_per_s"]["median"] / peers[base]["samples_per_s"]["median"]
    ceiling = (
        f"The target is out of reach on this machine: with no communication at all the ranks "
        f"reach {bound:.2f}x {base}'s samples/s, below {goal}x, so {base} already runs within "
        f"{(1 - 1 / bound) * 100:.0f} % of the bound. "
        if bound < goal
        else ""
    )
    shm = any(p["shm"] for p in row["ours_data_plane_per_rank"])
    plane = (
        "ours moved gradients through a shared-memory group, DDP through Gloo"
        if shm
        else "ours and DDP average the same gradients through the same Gloo allreduce on "
        "this host (ours held no shared-memory group)"
    )
    fast = min(p.get("engine", {}).get("fast", 0) for p in row["ours_data_plane_per_rank"])
    lane = (
        f"a step's gradients ran as one fused batch in the fast lane ({fast} ops, no coordinator), "
        if fast
        else "ours negotiates through rank 0's coordinator, "
    )
    return ceiling + (
        f"{plane}; ours submits one request per parameter from a Python hook; {lane}and "
        "its fused allreduce copies the gradients into the shared segment and back after "
        "backward, where DDP's C++ reducer fills buckets as backward runs and overlaps "
        f"their allreduce with it (tuned: the gradients are views of them). Measured here: ours reaches {row['ours_scaling_vs_no_comm']:.2f}x of the "
        f"ranks' samples/s alone, tuned DDP {row['ddp_tuned_scaling_vs_no_comm']:.2f}x."
    )


def _why_scaling(row: dict, goal: float) -> str:
    """The reason of a missed scaling target (issue 40), from what this run measured."""
    floor_ms = row["gradient_floor_s"]["median"] * 1e3
    bound = row["floor_bound_vs_no_comm"]
    alone_ms = row["peers"]["no_comm"]["step_s"]["median"] * 1e3
    ours_ms = row["peers"]["ours"]["step_s"]["median"] * 1e3
    head = (
        f"Out of reach on this machine: the least memory traffic of averaging this step's "
        f"gradients ({floor_ms:.1f} ms a rank: copy them into a shared buffer, reduce a half, "
        f"fetch the other half, in plain memory with no barrier) added to the ranks' "
        f"{alone_ms:.1f} ms step alone already gives {bound:.2f}x, below {goal}x; the 2 ranks "
        "fill both cores, so no communication overlaps compute. "
        if bound < goal
        else ""
    )
    return head + (
        f"Ours takes {ours_ms:.1f} ms a step against {alone_ms:.1f} ms alone, "
        f"{ours_ms - alone_ms - floor_ms:.1f} ms above the floor (the shared-memory rounds' "
        f"barriers, the fused batch's Python, the ranks' skew); ours reaches "
        f"{row['ours_scaling_vs_no_comm']:.2f}x, tuned DDP {row['ddp_tuned_scaling_vs_no_comm']:.2f}x."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    _common.add_common_args(parser)
    args = parser.parse_args()
    rounds = _common.check_rounds(args.rounds)
    steps = 5 if args.quick else args.steps
    env = _common.environment(("torch",))
    rows, checks, targets, lines = [], [], [], []
    for kind in ("mlp", "convnet"):
        per_rank = run_workers(_worker, np=2, args=(kind, steps, rounds, args.quick), timeout=3600)
        row, row_checks = _row(kind, per_rank, steps)
        rows.append(row)
        checks += row_checks
        for base in ("ddp", "ddp_tuned"):
            targets.append(
                _common.target(
                    f"{kind}: ours >= {TRAINING_GOAL}x {base} samples/s",
                    row[f"ours_vs_{base}"],
                    TRAINING_GOAL,
                    lower_is_better=False,
                    why_missed=_why(row, base, TRAINING_GOAL),
                )
            )
        goal = SCALING_GOAL[kind]
        targets.append(
            _common.target(
                f"{kind}: ours >= {goal}x the ranks' samples/s alone (no_comm)",
                row["ours_scaling_vs_no_comm"],
                goal,
                lower_is_better=False,
                why_missed=_why_scaling(row, goal),
            )
        )
        for name, p in row["peers"].items():
            lines.append(
                [
                    kind,
                    name,
                    _common.spread(p["step_s"], 1e3),
                    _common.spread(p["samples_per_s"], fmt="{:.0f}"),
                    ""
                    if name == "ours"
                    else f"{row['peers']['ours']['samples_per_s']['median'] / p['samples_per_s']['median']:.3g}",
                ]
            )
    t = _common.table(
        ["model", "peer", "ms per step, median (min-max)", "samples/s (2 ranks)", "ours / peer"],
        lines,
    )
    _common.print_table(t)
    _common.print_verdicts(targets, checks)
    _common.write(
        "training",
        args.out,
        env,
        {
            "np": 2,
            "threads": "torch.set_num_threads(1) on both ranks (every peer in the same process)",
            "peers": {
                "ours": "ringcore.torch.DistributedOptimizer(SGD), ringcore's Gloo group",
                "ddp": "DistributedDataParallel defaults, its own Gloo group",
                "ddp_tuned": "DDP with gradient_as_bucket_view=True, static_graph=True, "
                "bucket_cap_mb picked from a grid on this machine",
                "no_comm": "each rank trains alone at the same time (no averaging): the bound",
            },
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
