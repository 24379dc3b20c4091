"""Ray benchmark: ``ray_runner.RingTrainer.fit`` against Ray Train's ``TorchTrainer.fit``.

The same training function on 2 workers of one local Ray cluster (``num_cpus=2``,
127.0.0.1, dashboard off): an MLP on generated data, ``--steps`` SGD steps of batch 64
per worker, on two workloads: ``startup`` (``--steps``, default 300: a second of
training, so start-up dominates) and ``training`` (``--long-steps``, default 3,000:
training dominates). Ours averages gradients with ``ringcore.torch.DistributedOptimizer``;
theirs is DDP through ``ray.train.torch.prepare_model`` (Gloo). Ray Train runs with
``RAY_TRAIN_V2_ENABLED=1`` (the default of Ray 2.55, set explicitly here) and its
``RunConfig(storage_path=...)`` in a temporary folder, as is ours.

Measured per fit, on the driver's clock (one machine, so the workers' ``time.time()``
is comparable): ``fit_s`` (the whole ``fit()`` call), ``startup_s`` (from calling
``fit()`` until the train loop's first line runs on every worker: each worker writes
``time.time()`` at loop entry to a file), and ``ready_s`` (until every worker holds
its ready model, just before the first step: after ``hvd.init()`` and the parameter
broadcast for ours, after ``prepare_model`` for theirs). Per workload the
peers alternate for ``--rounds`` rounds (>= 5, the order swapped every round) after one
first fit each: cold on the fresh cluster for ``startup`` (new worker processes and
imports; ours first), an untimed warm-up for ``training`` (whose table row is
``fit_s`` only: its start-up is the same). The table gives the cold figure, the warm
median with min-max and the ratio ours/theirs (target <= 1.0x). Start-up is the latest
worker's stamp (the slowest rank). Check, per workload: both peers average the same
gradients from the same weights and data, so rank 0's final loss must agree (relative
1e-4). ``--quick``: 20 and 300 steps. Prints a table and writes
bench/results/ray_trainer.json.

Usage: python bench/ray_trainer.py [--steps 300] [--long-steps 3000] [--rounds 5] [--quick]
       [--out DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import _common

os.environ["RAY_TRAIN_V2_ENABLED"] = "1"  # before ray.train is imported

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


def _run_all(workloads: list[tuple[str, int]], rounds: int) -> tuple[dict, list[dict]]:
    """Per workload: the first fit of each peer (cold on the fresh cluster for the first
    workload, an untimed warm-up for the others), then the alternating rounds."""
    import ray

    storage = tempfile.mkdtemp(prefix="ray_trainer_bench_")
    ray.init(
        num_cpus=WORKERS,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        log_to_driver=False,
    )
    first: dict[str, dict] = {}
    runs = []
    try:
        for name, steps in workloads:
            first[name] = {peer: _fit(peer, steps, storage) for peer in ("ours", "theirs")}
            for r, order in enumerate(_common.orders(["ours", "theirs"], rounds)):
                for peer in order:
                    run = _fit(peer, steps, storage)
                    run.update(round=r, workload=name)
                    runs.append(run)
                    print(
                        f"{name} round {r} {peer:<6} fit {run['fit_s']:6.2f} s  startup "
                        f"{run['startup_s']:5.2f} s  ready {run['ready_s']:5.2f} s  "
                        f"loss {run['final_loss']:.4f}",
                        flush=True,
                    )
    finally:
        ray.shutdown()
    return first, runs


_METRICS = (
    ("fit_s", "total fit() wall time"),
    ("startup_s", "fit() -> loop entry on all workers"),
    ("ready_s", "fit() -> model ready on all workers"),
)


def _workload_report(name: str, first: dict, runs: list[dict], cold: bool) -> tuple:
    """Rows, table lines, targets and the loss check of one workload."""
    rows, lines, targets = [], [], []
    for key, what in _METRICS if cold else _METRICS[:1]:
        s = {p: _common.summary(r[key] for r in runs if r["peer"] == p) for p in ("ours", "theirs")}
        ratio = s["ours"]["median"] / s["theirs"]["median"]
        row = {"workload": name, "metric": key, "what": what, "warm": s, "warm_ratio": ratio}
        checked = [("warm", ratio)]
        if cold:
            row["cold"] = {p: first[p][key] for p in first}
            row["cold_ratio"] = first["ours"][key] / first["theirs"][key]
            checked.append(("cold", row["cold_ratio"]))
        rows.append(row)
        lines.append(
            [
                f"{name}: {key}",
                f"{first['ours'][key]:.2f} / {first['theirs'][key]:.2f}" if cold else "",
                f"{row['cold_ratio']:.3g}" if cold else "",
                _common.spread(s["ours"], fmt="{:.2f}"),
                _common.spread(s["theirs"], fmt="{:.2f}"),
                f"{ratio:.3g}",
            ]
        )
        for label, value in checked:
            targets.append(
                _common.target(
                    f"{name}: {key} ({what}), {label}: ours <= 1.0x TorchTrainer",
                    value,
                    1.0,
                    lower_is_better=True,
                    why_missed="not profiled in this run",
                )
            )
    losses = [r["final_loss"] for r in [*first.values(), *runs]]
    check = _common.check(
        f"{name}: rank 0's final loss equal for ours and TorchTrainer, every fit (relative 1e-4)",
        max(losses) - min(losses) <= 1e-4 * max(abs(x) for x in losses),
        f"losses {min(losses):.6g} .. {max(losses):.6g}",
    )
    return rows, lines, targets, check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps of the start-up workload")
    parser.add_argument(
        "--long-steps", type=int, default=3000, help="steps of the training workload"
    )
    _common.add_common_args(parser)
    args = parser.parse_args()
    rounds = _common.check_rounds(args.rounds)
    workloads = (
        [("startup", 20), ("training", 300)]
        if args.quick
        else [
            ("startup", args.steps),
            ("training", args.long_steps),
        ]
    )
    env = _common.environment(("torch", "ray"))
    first, runs = _run_all(workloads, rounds)
    rows, lines, targets, checks = [], [], [], []
    for i, (name, _) in enumerate(workloads):
        r, ln, tg, ck = _workload_report(
            name, first[name], [x for x in runs if x["workload"] == name], cold=i == 0
        )
        rows += r
        lines += ln
        targets += tg
        checks.append(ck)
    t = _common.table(
        [
            "workload: metric",
            "cold s ours / theirs",
            "cold ratio",
            "warm ours s",
            "warm theirs s",
            "warm ratio",
        ],
        lines,
    )
    _common.print_table(t)
    _common.print_verdicts(targets, checks)
    _common.write(
        "ray_trainer",
        args.out,
        env,
        {
            "what": "RingTrainer.fit vs ray.train.torch.TorchTrainer.fit (DDP), 2 workers",
            "setup": {
                "workers": WORKERS,
                "steps": dict(workloads),
                "per_worker_batch": BATCH,
                "model": "MLP 32-256-256-10, generated data",
                "threads": "torch.set_num_threads(1) in every worker of both peers",
                "RAY_TRAIN_V2_ENABLED": os.environ["RAY_TRAIN_V2_ENABLED"],
                "cluster": "ray.init(num_cpus=2, _node_ip_address='127.0.0.1', dashboard off)",
            },
            "targets": targets,
            "checks": checks,
            "table": t,
            "summary": rows,
            "first_runs": first,
            "runs": runs,
        },
        quick=args.quick,
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
