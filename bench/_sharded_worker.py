"""One rank of bench/sharded.py: build the GPT-2 model from its config, set it up as one
side, train ``--warmup`` then ``--steps`` timed AdamW steps, write this rank's figures.

Sides: ``ring``, ``ddp`` and ``fsdp`` are ours, set up by
``ringcore.torch.strategies.get_strategy(side).prepare(model, AdamW)`` and launched by
``ringrun``; ``fsdp2_by_hand`` is the same FSDP2 as a plain torchrun script would write
it (``init_process_group``, ``fully_shard`` on every block then the root, AdamW after),
and imports nothing of ringcore. Every side runs the same model (seed 0 on every rank),
per-rank batch (seed 100 + rank), loss and timed loop, with one torch thread per rank.

With ``--limit-mode`` the rank holds itself to ``--limit-bytes`` (bench/_memlimit.py)
before importing torch, so the model, gradients and optimizer state all count.
Usage (the driver builds the command): ringrun -np 2 python bench/_sharded_worker.py
--side fsdp --out DIR [--layers 24 --width 1024 --heads 16 --seq 128 --batch 1 ...]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import time
from typing import Any

import _memlimit

SIDES = ("ring", "ddp", "fsdp", "fsdp2_by_hand")
LR = 1e-4


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--side", choices=SIDES, required=True)
    p.add_argument("--out", type=pathlib.Path, required=True, help="folder of rank<N>.json")
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50257)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=1, help="sequences per rank and step")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--limit-mode", choices=_memlimit.MODES)
    p.add_argument("--limit-parent", default="", help="the driver's cgroup folder")
    p.add_argument("--limit-bytes", type=int, default=0)
    return p.parse_args()


def _build(args: argparse.Namespace, rank: int) -> tuple[Any, Any]:
    """GPT-2 from a config (no download, no dropout: every side computes the same), and
    this rank's token batch."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
        n_positions=args.seq, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    gen = torch.Generator().manual_seed(100 + rank)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen)
    return model, tokens


def _ours(side: str, model: Any, opt: Any) -> tuple[Any, Any]:
    """(what to call, a step) through our strategies: ringcore forms the group."""
    from ringcore.torch.strategies import get_strategy

    run = get_strategy(side).prepare(model, opt)
    return run.model, run.step


def _by_hand(model: Any) -> tuple[Any, Any]:
    """FSDP2 as torch's documentation writes it: each block, then the root; AdamW after."""
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    for block in model.transformer.h:
        fully_shard(block)
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step() -> None:
        opt.step()
        opt.zero_grad()

    return model, step


def _checksum(model: Any) -> float:
    """sum |w| over the whole model (shards summed over the ranks; tied weights once)."""
    import torch
    import torch.distributed as dist

    local = torch.zeros((), dtype=torch.float64)
    sharded = False
    for p in model.parameters():
        t = p.detach()
        if hasattr(t, "to_local"):
            t, sharded = t.to_local(), True
        local += t.double().abs().sum()
    if sharded:
        dist.all_reduce(local)
    return float(local)


def _train(call: Any, step: Any, tokens: Any, n: int) -> list[float]:
    losses = []
    for _ in range(n):
        loss = call(tokens, labels=tokens).loss
        loss.backward()
        step()
        losses.append(float(loss.detach()))
    return losses


def _rss() -> dict[str, int]:
    """This process's peak and current resident set (bytes)."""
    found = {"peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}
    for line in pathlib.Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS"):
            found[key] = int(value.split()[0]) * 1024
    return found


def main() -> None:
    args = _args()
    if args.limit_mode:
        _memlimit.join(args.limit_mode, args.limit_parent, args.limit_bytes)
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])  # ringrun and torchrun both set it
    t0 = time.perf_counter()
    model, tokens = _build(args, rank)
    parameters = sum(p.numel() for p in model.parameters())
    if args.side == "fsdp2_by_hand":
        call, step = _by_hand(model)
    else:
        call, step = _ours(args.side, model, torch.optim.AdamW(model.parameters(), lr=LR))
    rank, world = dist.get_rank(), dist.get_world_size()
    setup_s = time.perf_counter() - t0
    warm = _train(call, step, tokens, args.warmup)
    dist.barrier()
    t0 = time.perf_counter()
    timed = _train(call, step, tokens, args.steps)
    seconds = time.perf_counter() - t0
    last = torch.tensor([timed[-1] if timed else warm[-1]], dtype=torch.float64)
    dist.all_reduce(last)
    result = {
        "side": args.side,
        "rank": rank,
        "world": world,
        "parameters": parameters,
        "setup_s": setup_s,
        "timed_s": seconds,
        "losses": warm + timed,
        "mean_last_loss": float(last) / world,
        "checksum": _checksum(model),
        **_rss(),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"rank{rank}.json").write_text(json.dumps(result) + "\n")
    dist.barrier()


if __name__ == "__main__":
    main()
