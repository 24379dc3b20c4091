"""The torch.distributed backend "ring" against "gloo": DDP and FSDP2, 2 ranks on one host.

Both peers live in the same 2 processes (``torch.set_num_threads(1)`` on each), so both
see the same machine at the same moment: the job's default group is ``"ring"``
(``import ringcore.dist_backend``), and a Gloo group over the same ranks
(``dist.new_group(backend="gloo")``) carries the other peer. Only the group differs.

- **DDP** (defaults) on the MLP of bench/training.py (~10 M parameters; quick: ~0.27 M),
  SGD, each rank its own batch: samples/s of DDP over ring and over gloo, and "no_comm"
  (each rank training the same model alone at the same time: the bound).
- **FSDP2** (``fully_shard`` on each block, then the root) on a small transformer at a
  communication-bound size: few tokens per rank per step, so the all-gathers and
  reduce-scatters of ~4 M parameters dominate. "no_comm" is the same model trained
  unsharded on each rank alone: gloo's communication share is reported as
  ``1 - no_comm's step time / gloo's`` (FSDP2's own sharding work counts as communication
  there: it is what the group's speed cannot remove).

Each of ``--rounds`` rounds (>= 5, the peers' order swapped every round) starts every
peer from the same weights and times ``--steps`` steps on every rank; the round's figure
is the slowest rank's. Checks: ring's and gloo's final weights (DDP) or losses (FSDP2)
are equal on every rank, every round, and each peer's weights agree across ranks.
Targets: DDP over ring >= 1.15x DDP over gloo; FSDP2 over ring >= 1.3x over gloo.
Usage: python bench/torch_backend.py [--steps 20] [--rounds 5] [--quick] [--out DIR]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import _common
from training import _build

from ringcore.testing import run_workers

PEERS = ("ring", "gloo", "no_comm")
DDP_GOAL, FSDP_GOAL = 1.15, 1.3


def _transformer(quick: bool):
    import torch

    width, layers, vocab = (64, 2, 256) if quick else (256, 4, 2048)

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(vocab, width)
            self.blocks = torch.nn.ModuleList(
                torch.nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True)
                for _ in range(layers)
            )
            self.head = torch.nn.Linear(width, vocab)

        def forward(self, tokens):
            x = self.embed(tokens)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    torch.manual_seed(0)
    return Tiny(), vocab


class _Peer:
    """A model, its optimizer, its initial state and one way of taking a step."""

    def __init__(self, model, make_opt, batch) -> None:
        import torch

        self.model, self.make_opt, self.batch = model, make_opt, batch
        self.init = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.opt = make_opt(model)
        self.loss = torch.tensor(0.0)

    def reset(self) -> None:
        import torch

        with torch.no_grad():
            for k, v in self.model.state_dict().items():
                v.copy_(self.init[k])
        self.opt = self.make_opt(self.model)

    def steps(self, n: int) -> float:
        import torch

        x, y = self.batch
        for _ in range(n):
            self.opt.zero_grad()
            out = self.model(x)
            self.loss = torch.nn.functional.cross_entropy(out.flatten(0, -2), y.flatten())
            self.loss.backward()
            self.opt.step()
        return float(self.loss.detach())

    def checksum(self) -> float:
        return sum(float(v.full_tensor().double().abs().sum()) if hasattr(v, "full_tensor")
                   else float(v.double().abs().sum()) for v in self.model.state_dict().values())  # fmt: skip


def _ddp_peers(quick: bool, rank: int, gloo) -> dict[str, _Peer]:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    def sgd(m):
        return torch.optim.SGD(m.parameters(), lr=0.01)

    out = {}
    for name, group in (("ring", None), ("gloo", gloo)):
        model, x, y = _build("mlp", quick, rank)
        out[name] = _Peer(DDP(model, process_group=group), sgd, (x, y))
    model, x, y = _build("mlp", quick, rank)
    out["no_comm"] = _Peer(model, sgd, (x, y))
    return out


def _fsdp_peers(quick: bool, rank: int, gloo) -> dict[str, _Peer]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    def adamw(m):
        return torch.optim.AdamW(m.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(100 + rank)
    out = {}
    for name, group in (("ring", dist.group.WORLD), ("gloo", gloo), ("no_comm", None)):
        model, vocab = _transformer(quick)
        tokens = torch.randint(
            0, vocab, (2, 8 if quick else 16), generator=gen.manual_seed(100 + rank)
        )
        if group is not None:
            mesh = DeviceMesh.from_group(group, "cpu")
            for block in model.blocks:
                fully_shard(block, mesh=mesh)
            fully_shard(model, mesh=mesh)
        out[name] = _Peer(model, adamw, (tokens, tokens.roll(1, 1)))
    return out


def _worker(kind: str, steps: int, rounds: int, quick: bool) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    import ringcore.dist_backend  # noqa: F401  (registers "ring")

    torch.set_num_threads(1)
    dist.init_process_group("ring")
    rank, pg = dist.get_rank(), dist.group.WORLD
    gloo = dist.new_group(backend="gloo")
    peers = (_ddp_peers if kind == "ddp" else _fsdp_peers)(quick, rank, gloo)
    for peer in peers.values():  # warm-up: buffers, buckets, FSDP's lazy init
        peer.steps(2)
    times: dict[str, list[float]] = {n: [] for n in peers}
    loss: dict[str, list[float]] = {n: [] for n in peers}
    sums: dict[str, list[float]] = {n: [] for n in peers}
    for order in _common.orders(list(peers), rounds):
        for name in order:
            peer = peers[name]
            peer.reset()
            dist.barrier(gloo)
            t0 = time.perf_counter()
            loss[name].append(peer.steps(steps))
            times[name].append(time.perf_counter() - t0)
            sums[name].append(peer.checksum())
    out = {"rank": rank, "times": times, "loss": loss, "sums": sums, "stats": dict(pg.stats)}
    out["reason"], out["batch"] = pg.reason, int(peers["ring"].batch[0].shape[0])
    out["tokens"] = int(peers["ring"].batch[0].numel())
    out["parameters"] = sum(v.numel() for v in peers["no_comm"].init.values())
    dist.destroy_process_group()
    return out


def _row(kind: str, per_rank: list[dict], steps: int) -> tuple[dict, list[dict]]:
    n, batch = len(per_rank), per_rank[0]["batch"]
    peers = {}
    for name in PEERS:
        rounds = _common.slowest([r["times"][name] for r in per_rank])
        peers[name] = {
            "step_s": _common.summary(t / steps for t in rounds),
            "samples_per_s": _common.summary(n * batch * steps / t for t in rounds),
        }
    what = "final weights" if kind == "ddp" else "losses and final weights"
    same = all(
        r["sums"]["ring"] == r["sums"]["gloo"]
        and (kind == "ddp" or r["loss"]["ring"] == r["loss"]["gloo"])
        for r in per_rank
    )
    # FSDP2's checksum is of the full tensors (gathered): the same on every rank too
    across = all(per_rank[0]["sums"][p] == per_rank[1]["sums"][p] for p in ("ring", "gloo"))
    checks = [
        _common.check(f"{kind}: ring's and gloo's {what} equal on every rank, every round", same,
                      f"rank 0 checksums ring {per_rank[0]['sums']['ring'][-1]:.6g}, "
                      f"gloo {per_rank[0]['sums']['gloo'][-1]:.6g}"),
        _common.check(f"{kind}: each peer's weights equal across ranks", across),
        _common.check(f"{kind}: ring held the shared-memory group on every rank",
                      all(r["reason"] == "every rank on one host" and r["stats"]["shm"] > 0
                          for r in per_rank), str([r["stats"] for r in per_rank])),
    ]  # fmt: skip
    med = {p: peers[p]["step_s"]["median"] for p in PEERS}
    row = {
        "model": "mlp (bench/training.py)" if kind == "ddp" else "transformer",
        "parallel": kind,
        "parameters": per_rank[0]["parameters"],
        "per_rank_batch": batch,
        "tokens_per_rank_step": per_rank[0]["tokens"] if kind == "fsdp" else None,
        "steps_per_round": steps,
        "peers": peers,
        "ring_vs_gloo": med["gloo"] / med["ring"],
        "gloo_comm_share": max(0.0, 1 - med["no_comm"] / med["gloo"]),
        "ring_comm_share": max(0.0, 1 - med["no_comm"] / med["ring"]),
        "ring_stats_per_rank": [r["stats"] for r in per_rank],
    }
    return row, checks


def _why(row: dict, goal: float) -> str:
    bound = row["peers"]["gloo"]["step_s"]["median"] / row["peers"]["no_comm"]["step_s"]["median"]
    return (
        f"ring reached {row['ring_vs_gloo']:.2f}x; with no communication at all the ranks reach "
        f"{bound:.2f}x gloo's speed (gloo's communication share {row['gloo_comm_share']:.0%}, "
        f"ring's {row['ring_comm_share']:.0%}). Ring's ops run on the caller's thread, in "
        "Python, one 1 MiB chunk per round trip through the segment, and do not overlap "
        "backward as Gloo's asynchronous work does."
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
    for kind, goal in (("ddp", DDP_GOAL), ("fsdp", FSDP_GOAL)):
        per_rank = run_workers(_worker, np=2, args=(kind, steps, rounds, args.quick), timeout=3600)
        row, row_checks = _row(kind, per_rank, steps)
        rows.append(row)
        checks += row_checks
        targets.append(_common.target(
            f"{kind} over ring >= {goal}x over gloo (samples/s)", row["ring_vs_gloo"], goal,
            lower_is_better=False, why_missed=_why(row, goal)))  # fmt: skip
        for name, p in row["peers"].items():
            ratio = row["peers"]["gloo"]["step_s"]["median"] / p["step_s"]["median"]
            lines.append([
                kind, row["model"], name, _common.spread(p["step_s"], 1e3),
                _common.spread(p["samples_per_s"], fmt="{:.0f}"),
                f"{ratio:.3g}", f"{row['gloo_comm_share']:.0%}" if name == "gloo" else "",
            ])  # fmt: skip
    t = _common.table(
        ["parallel", "model", "group", "ms per step, median (min-max)", "samples/s (2 ranks)",
         "vs gloo", "gloo comm share"],
        lines,
    )  # fmt: skip
    _common.print_table(t)
    _common.print_verdicts(targets, checks)
    _common.write(
        "torch_backend",
        args.out,
        env,
        {
            "np": 2,
            "threads": "torch.set_num_threads(1) on both ranks (every peer in the same process)",
            "peers": {
                "ring": 'the default group, backend "ring" (ringcore.dist_backend)',
                "gloo": 'dist.new_group(backend="gloo") over the same ranks',
                "no_comm": "each rank trains the model alone at the same time: the bound",
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
