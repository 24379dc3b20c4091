"""Training benchmark: ringcore.torch.DistributedOptimizer against DDP on Gloo and
one process, same model, data and per-rank batch, 2 ranks, one run.

Prints a table and writes bench/results/training.json. Each rank runs
``torch.set_num_threads(1)``. Usage: python bench/training.py [--steps 20] [--quick]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import time

from ringcore.testing import run_workers

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BATCH = 64


def _build(kind: str):
    import torch

    torch.manual_seed(0)
    if kind == "mlp":  # ~10 M parameters
        model = torch.nn.Sequential(
            torch.nn.Linear(784, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 2048),
            torch.nn.ReLU(),
            torch.nn.Linear(2048, 10),
        )
        x = torch.randn(BATCH, 784)
    else:  # a small conv net on 32x32 images
        model = torch.nn.Sequential(
            torch.nn.Conv2d(3, 32, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Conv2d(32, 64, 3, padding=1),
            torch.nn.ReLU(),
            torch.nn.MaxPool2d(2),
            torch.nn.Flatten(),
            torch.nn.Linear(64 * 8 * 8, 128),
            torch.nn.ReLU(),
            torch.nn.Linear(128, 10),
        )
        x = torch.randn(BATCH, 3, 32, 32)
    y = torch.randint(0, 10, (BATCH,))
    return model, x, y


def _loop(model, opt, x, y, steps: int, barrier) -> float:
    import torch

    loss_fn = torch.nn.functional.cross_entropy
    for _ in range(3):  # warm-up
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()
    barrier()
    return (time.perf_counter() - t0) / steps


def _ours(kind: str, steps: int):
    import torch

    import ringcore.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    model, x, y = _build(kind)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    return _loop(model, opt, x, y, steps, hvd.barrier)


def _ddp(kind: str, steps: int):
    import datetime
    import os

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    store = dist.TCPStore(
        os.environ["RING_STORE_ADDR"],
        int(os.environ["RING_STORE_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    dist.init_process_group(
        "gloo",
        store=dist.PrefixStore("ddp", store),
        rank=int(os.environ["RING_RANK"]),
        world_size=int(os.environ["RING_SIZE"]),
    )
    model, x, y = _build(kind)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
    try:
        return _loop(ddp, opt, x, y, steps, dist.barrier)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    steps = 5 if args.quick else args.steps
    rows = []
    for kind in ("mlp", "convnet"):
        ours = max(run_workers(_ours, np=2, args=(kind, steps), timeout=900))
        ddp = max(run_workers(_ddp, np=2, args=(kind, steps), timeout=900))
        single = run_workers(_ours, np=1, args=(kind, steps), timeout=900)[0]
        row = {
            "model": kind,
            "per_rank_batch": BATCH,
            "steps": steps,
            "ours_step_s": ours,
            "ddp_step_s": ddp,
            "single_step_s": single,
            "ours_samples_per_s": 2 * BATCH / ours,
            "ddp_samples_per_s": 2 * BATCH / ddp,
            "single_samples_per_s": BATCH / single,
        }
        row["ours_vs_ddp"] = row["ours_samples_per_s"] / row["ddp_samples_per_s"]
        row["ours_scaling_efficiency"] = row["ours_samples_per_s"] / (
            2 * row["single_samples_per_s"]
        )
        row["ddp_scaling_efficiency"] = row["ddp_samples_per_s"] / (2 * row["single_samples_per_s"])
        rows.append(row)
    print(
        f"{'model':<9}{'ours ms':>9}{'DDP ms':>9}{'1-proc ms':>10}{'ours/s':>9}{'DDP/s':>9}"
        f"{'ours/DDP':>9}{'ours eff':>9}{'DDP eff':>9}"
    )
    for r in rows:
        print(
            f"{r['model']:<9}{r['ours_step_s'] * 1e3:>9.1f}{r['ddp_step_s'] * 1e3:>9.1f}{r['single_step_s'] * 1e3:>10.1f}"
            f"{r['ours_samples_per_s']:>9.0f}{r['ddp_samples_per_s']:>9.0f}{r['ours_vs_ddp']:>9.2f}"
            f"{r['ours_scaling_efficiency']:>9.0%}{r['ddp_scaling_efficiency']:>9.0%}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "training.json"
    out.write_text(
        json.dumps(
            {
                "machine": platform.platform(),
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "target": "ours_vs_ddp >= 1.0",
                "rows": rows,
            },
            indent=2,
        )
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
