"""Spark launch overhead: ``spark_runner.run`` against pyspark's ``TorchDistributor``.

Both run the same function (``ringcore.torch`` init and one allreduce; ringcore reads
torchrun's variables under TorchDistributor) on 2 barrier tasks of one ``local[2]``
session: ``spark_runner.run(fn, num_proc=2)`` and ``TorchDistributor(num_processes=2,
local_mode=False, use_gpu=False).run(fn)`` (each task starts ``torchrun``, which starts
the function's process). One untimed warm-up each (Spark starts its Python workers),
then the peers alternate for ``--rounds`` rounds (>= 5, the order swapped every round).
The cold figure is each peer's first call on the fresh session (Spark starts its Python
workers; ours runs first), the warm figures the rounds' median and min-max. The clock is
the driver's: a call returns when its slowest task is done. Check: both return the
allreduce's sum (3.0 on every rank). Target: ours / theirs <= 1.0 on the warm median.
``--quick`` changes nothing but the label (the launch is the workload; TorchDistributor's
~10 s a call makes this bench take ~1.5 min). Prints a table and writes
bench/results/spark_launch.json.
Usage: python bench/spark_launch.py [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Any

import _common

import spark_runner


def one_allreduce():
    import torch

    import ringcore.torch as hvd

    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    hvd.shutdown()
    return total


def _ours() -> object:
    return spark_runner.run(one_allreduce, num_proc=2, verbose=0)


def _theirs() -> object:
    from pyspark.ml.torch.distributor import TorchDistributor

    return TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(one_allreduce)


def _timed(fn) -> tuple[float, object]:
    started = time.perf_counter()
    result = fn()
    return time.perf_counter() - started, result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _common.add_common_args(parser)
    opts = parser.parse_args()
    rounds = _common.check_rounds(opts.rounds)
    env = _common.environment(("torch", "pyspark"))
    logging.getLogger("TorchDistributor").setLevel(logging.WARNING)
    spark = spark_runner.local_session("local[2]", app_name="bench_spark_launch")
    peers = {"spark_runner.run": _ours, "TorchDistributor.run": _theirs}
    expected = {"spark_runner.run": [3.0, 3.0], "TorchDistributor.run": 3.0}
    results: dict[str, list[Any]] = {name: [] for name in peers}
    try:
        cold = {}
        for name, fn in peers.items():
            cold[name], result = _timed(fn)
            results[name].append(result)
        times: dict[str, list[float]] = {name: [] for name in peers}
        for order in _common.orders(list(peers), rounds):
            for name in order:
                elapsed, result = _timed(peers[name])
                times[name].append(elapsed)
                results[name].append(result)
    finally:
        spark.stop()

    summaries = {name: _common.summary(ts) for name, ts in times.items()}
    ours, theirs = summaries["spark_runner.run"], summaries["TorchDistributor.run"]
    ratio = ours["median"] / theirs["median"]
    cold_ratio = cold["spark_runner.run"] / cold["TorchDistributor.run"]
    checks = [
        _common.check(
            f"{name} returned the allreduce's sum every call ({expected[name]})",
            all(r == expected[name] for r in results[name]),
            f"{len(results[name])} calls",
        )
        for name in peers
    ]
    targets = [
        _common.target(
            "launch + one allreduce on 2 tasks, warm: ours <= 1.0x TorchDistributor",
            ratio,
            1.0,
            lower_is_better=True,
            why_missed="not profiled in this run",
        )
    ]
    t = _common.table(
        ["runner", "cold s (first call)", "warm s, median (min-max)", "ours / theirs (warm)"],
        [
            [
                name,
                f"{cold[name]:.2f}",
                _common.spread(s, fmt="{:.2f}"),
                f"{ratio:.3g}" if name == "spark_runner.run" else "",
            ]
            for name, s in summaries.items()
        ],
    )
    _common.print_table(t)
    _common.print_verdicts(targets, checks)
    _common.write(
        "spark_launch",
        opts.out,
        env,
        {
            "what": "launch overhead: run of one allreduce on 2 barrier tasks, local[2]",
            "master": "local[2]",
            "cold_s": cold,
            "cold_ratio": cold_ratio,
            "runners": summaries,
            "ratio_median": ratio,
            "targets": targets,
            "checks": checks,
            "table": t,
        },
        quick=opts.quick,
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
