"""Spark launch overhead: ``spark_runner.run`` against pyspark's ``TorchDistributor``.

Both run the same function (``ringcore.torch`` init and one allreduce; ringcore reads
torchrun's variables under TorchDistributor) on 2 barrier tasks of one ``local[2]``
session: ``spark_runner.run(fn, num_proc=2)`` and ``TorchDistributor(num_processes=2,
local_mode=False, use_gpu=False).run(fn)`` (each task starts ``torchrun``, which starts
the function's process). One untimed warm-up each (Spark starts its Python workers),
then the peers alternate for ``--rounds`` rounds. Target: ours / theirs <= 1.0 on the
median. Prints a table and writes bench/results/spark_launch.json.
Usage: python bench/spark_launch.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import pathlib
import platform
import statistics
import time
from typing import Any

import spark_runner

RESULTS = pathlib.Path(__file__).resolve().parent / "results"


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
    parser.add_argument("--rounds", type=int, default=3)
    opts = parser.parse_args()
    logging.getLogger("TorchDistributor").setLevel(logging.WARNING)
    spark = spark_runner.local_session("local[2]", app_name="bench_spark_launch")
    peers = {"spark_runner.run": _ours, "TorchDistributor.run": _theirs}
    try:
        first = {}
        for name, fn in peers.items():
            first[name], result = _timed(fn)
            print(f"warm-up {name}: {first[name]:.2f} s, result {result}")
        assert _ours() == [3.0, 3.0] and _theirs() == 3.0  # both really ran the allreduce
        times: dict[str, list[float]] = {name: [] for name in peers}
        for _ in range(opts.rounds):
            for name, fn in peers.items():
                times[name].append(_timed(fn)[0])
    finally:
        spark.stop()

    rows: dict[str, dict[str, Any]] = {
        name: {
            "first_s": round(first[name], 3),
            "best_s": round(min(ts), 3),
            "median_s": round(statistics.median(ts), 3),
            "all_s": [round(t, 3) for t in ts],
        }
        for name, ts in times.items()
    }
    ours, theirs = rows["spark_runner.run"], rows["TorchDistributor.run"]
    ratio_median = ours["median_s"] / theirs["median_s"]
    ratio_best = ours["best_s"] / theirs["best_s"]
    print(f"\nlaunch + one allreduce on 2 tasks, local[2], {opts.rounds} alternating rounds")
    print(f"{'runner':<22}{'first s':>10}{'best s':>10}{'median s':>10}")
    for name, row in rows.items():
        print(f"{name:<22}{row['first_s']:>10.2f}{row['best_s']:>10.2f}{row['median_s']:>10.2f}")
    verdict = "met" if ratio_median <= 1.0 else "MISSED"
    print(
        f"ours/theirs: median {ratio_median:.2f}x, best {ratio_best:.2f}x (target <= 1.0x: {verdict})"
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "spark_launch.json"
    out.write_text(
        json.dumps(
            {
                "benchmark": "spark launch overhead: run of one allreduce on 2 tasks",
                "master": "local[2]",
                "rounds": opts.rounds,
                "runners": rows,
                "ratio_median": round(ratio_median, 3),
                "ratio_best": round(ratio_best, 3),
                "target": "<= 1.0x (median)",
                "met": ratio_median <= 1.0,
                "machine": f"{platform.machine()}, {platform.python_version()}",
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
