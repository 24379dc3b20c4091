"""Ray benchmark: ``ray_runner.RingTrainer.fit`` against Ray Train's ``TorchTrainer.fit``.

The same training function on 2 workers of one local Ray cluster (``num_cpus=2``,
127.0.0.1, dashboard off): an MLP on generated data, ``--steps`` SGD steps of batch 64
per worker. Ours averages gradients with ``ringcore.torch.DistributedOptimizer``;
theirs is DDP through ``ray.train.torch.prepare_model`` (Gloo). Ray Train runs with
``RAY_TRAIN_V2_ENABLED=1`` (the default of Ray 2.55, set explicitly here) and its
``RunConfig(storage_path=...)`` in a temporary folder, as is ours.

Measured per fit, on the driver's clock (one machine, so the workers' ``time.time()``
is comparable): ``fit_s`` (the whole ``fit()`` call), ``startup_s`` (from calling
``fit()`` until the train loop's first line runs on every worker: each worker writes
``time.time()`` at loop entry to a file), and ``ready_s`` (until every worker holds
its ready model, just before the first step: after ``hvd.init()`` and the parameter
broadcast for ours, after ``prepare_model`` for theirs). The peers alternate for
``--rounds`` rounds; the table gives the median of each and the ratio ours/theirs
(target <= 1.0x). Prints a table and writes bench/results/ray_trainer.json.

Usage: python bench/ray_trainer.py [--steps 300] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import tempfile
import time

os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # before ray.train is imported

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
BATCH = 64
WORKERS = 2


def _write(folder: str, name: str, value: float) -> None:
    with open(os.path.join(folder, name), "w") as fh:
        fh.write(repr(value))


def _stamp(folder: str, kind: str, rank: int) -> None:
    _write(folder, f"{kind}_{rank}", time.time())


def _data_and_model(rank: int):
    import torch

    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(4096, 32, generator=gen)
    y = (x @ torch.randn(32, 10, generator=torch.Generator().manual_seed(7))).argmax(dim=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 256),
        torch.nn.ReLU(),
        torch.nn.Linear(256, 10),
    )
    return x, y, model


def _train(model, opt, x, y, steps: int) -> float:
    import torch

    loss = torch.tensor(0.0)
    for step in range(steps):
        i = (step * BATCH) % (len(x) - BATCH)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[i : i + BATCH]), y[i : i + BATCH])
        loss.backward()
        opt.step()
    return float(loss)


def ours_loop(config):
    import ray_runner
    import ringcore.torch as hvd

    rank = ray_runner.get_context().get_world_rank()
    _stamp(config["stamps"], "entry", rank)
    import torch

    hvd.init()
    x, y, model = _data_and_model(rank)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), named_parameters=model.named_parameters()
    )
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    _stamp(config["stamps"], "ready", rank)
    loss = _train(model, opt, x, y, config["steps"])
    _write(config["stamps"], f"loss_{rank}", loss)
    ray_runner.report({"loss": loss})


def theirs_loop(config):
    import ray.train
    import ray.train.torch

    rank = ray.train.get_context().get_world_rank()
    _stamp(config["stamps"], "entry", rank)
    import torch

    x, y, model = _data_and_model(rank)
    model = ray.train.torch.prepare_model(model)  # DDP over Gloo on CPU
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    _stamp(config["stamps"], "ready", rank)
    loss = _train(model, opt, x, y, config["steps"])
    _write(config["stamps"], f"loss_{rank}", loss)
    ray.train.report({"loss": loss})


def _fit(peer: str, steps: int, storage: str) -> dict:
    stamps = tempfile.mkdtemp(prefix="stamps_", dir=storage)
    config = {"steps": steps, "stamps": stamps}
    if peer == "ours":
        import ray_runner

        trainer = ray_runner.RingTrainer(
            ours_loop,
            train_loop_config=config,
            scaling_config=ray_runner.ScalingConfig(num_workers=WORKERS),
            run_config=ray_runner.RunConfig(storage_path=storage, verbose=0),
        )
    else:
        import ray.train
        import ray.train.torch

        trainer = ray.train.torch.TorchTrainer(
            theirs_loop,
            train_loop_config=config,
            scaling_config=ray.train.ScalingConfig(num_workers=WORKERS, use_gpu=False),
            run_config=ray.train.RunConfig(storage_path=storage, name=f"theirs_{time.time_ns()}"),
        )
    t0 = time.time()
    trainer.fit()
    fit_s = time.time() - t0

    def latest(kind: str) -> float:
        times = []
        for rank in range(WORKERS):
            with open(os.path.join(stamps, f"{kind}_{rank}")) as fh:
                times.append(float(fh.read()))
        return max(times) - t0

    return {
        "peer": peer,
        "fit_s": fit_s,
        "startup_s": latest("entry"),
        "ready_s": latest("ready"),
        # rank 0's last loss, from its file (Ray Train V2's Result.metrics is None
        # when no checkpoint was reported)
        "final_loss": float(open(os.path.join(stamps, "loss_0")).read()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    import ray

    storage = tempfile.mkdtemp(prefix="ray_trainer_bench_")
    ray.init(
        num_cpus=WORKERS,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
    )
    runs = []
    try:
        _fit("ours", 5, storage)  # warm-up: the first worker processes, imports
        _fit("theirs", 5, storage)
        for r in range(args.rounds):
            order = ("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")
            for peer in order:
                run = _fit(peer, args.steps, storage)
                run["round"] = r
                runs.append(run)
                print(
                    f"round {r} {peer:<6} fit {run['fit_s']:6.2f} s  startup "
                    f"{run['startup_s']:5.2f} s  ready {run['ready_s']:5.2f} s  "
                    f"loss {run['final_loss']:.3f}",
                    flush=True,
                )
    finally:
        ray.shutdown()

    def median(peer: str, key: str) -> float:
        return statistics.median(run[key] for run in runs if run["peer"] == peer)

    rows = []
    for key, what in (
        ("fit_s", "total fit() wall time"),
        ("startup_s", "fit() -> loop entry on all workers"),
        ("ready_s", "fit() -> model ready on all workers"),
    ):
        ours, theirs = median("ours", key), median("theirs", key)
        rows.append(
            {
                "metric": key,
                "what": what,
                "ours_s": ours,
                "theirs_s": theirs,
                "ratio": ours / theirs,
                "target_met": ours / theirs <= 1.0,
            }
        )
    print(f"\n{'metric':<10} {'ours s':>8} {'theirs s':>9} {'ours/theirs':>12}  what")
    for row in rows:
        flag = "" if row["target_met"] else "  (above the 1.0x target)"
        print(
            f"{row['metric']:<10} {row['ours_s']:8.2f} {row['theirs_s']:9.2f} "
            f"{row['ratio']:11.2f}x  {row['what']}{flag}"
        )
    import ray as ray_module
    import torch

    out = {
        "benchmark": "RingTrainer.fit vs ray.train.torch.TorchTrainer.fit (DDP), 2 workers",
        "setup": {
            "workers": WORKERS,
            "steps": args.steps,
            "per_worker_batch": BATCH,
            "model": "MLP 32-256-256-10, generated data",
            "rounds": args.rounds,
            "ray": ray_module.__version__,
            "torch": torch.__version__,
            "RAY_TRAIN_V2_ENABLED": os.environ["RAY_TRAIN_V2_ENABLED"],
            "cluster": "ray.init(num_cpus=2, _node_ip_address='127.0.0.1', dashboard off)",
            "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "statistic": "median over rounds; peers alternate each round",
        },
        "summary": rows,
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "ray_trainer.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"\nwrote {RESULTS / 'ray_trainer.json'}")


if __name__ == "__main__":
    main()
