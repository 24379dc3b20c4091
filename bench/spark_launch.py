"""Spark launch overhead: ``spark_runner.run`` against pyspark's ``TorchDistributor``.

All run the same program (``ringcore.torch`` init and one allreduce; ringcore reads
torchrun's variables under TorchDistributor) on 2 barrier tasks of one ``local[2]``
session, as a function and as a Python file: ``spark_runner.run(fn, num_proc=2)``,
``TorchDistributor(num_processes=2, local_mode=False, use_gpu=False).run(fn)`` (PySpark's:
each task starts ``torchrun``, which starts the function's process), and ringtrain's
drop-in ``spark_runner.TorchDistributor`` with the same arguments; the file forms run
``one_allreduce.py`` (exit 1 on a wrong sum). One untimed warm-up each (Spark starts its Python workers),
then the peers alternate for ``--rounds`` rounds (>= 5, the order swapped every round).
The cold figure is each peer's first call on the fresh session (Spark starts its Python
workers; ours runs first), the warm figures the rounds' median and min-max. The clock is
the driver's: a call returns when its slowest task is done. Check: the functions return
the allreduce's sum (3.0 on every rank), the files None. Targets: each of ours / PySpark's
of the same form <= 1.0 on the warm median.
``--quick`` changes nothing but the label (the launch is the workload; PySpark's
~10-15 s a call makes this bench take ~4 min). Prints a table and writes
bench/results/spark_launch.json.
Usage: python bench/spark_launch.py [--rounds 5] [--out DIR]
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
import time
from collections.abc import Callable
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


#: the file form's program: the same allreduce, exiting 1 when the sum is wrong
SCRIPT = """
import sys
import torch
import ringcore.torch as hvd

hvd.init()
total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
hvd.shutdown()
sys.exit(0 if total == 3.0 else 1)
"""


def _script() -> str:
    path = os.path.join(tempfile.mkdtemp(prefix="bench-spark-launch-"), "one_allreduce.py")
    with open(path, "w") as f:
        f.write(SCRIPT)
    return path


def _peers(script: str) -> dict[str, Callable[[], object]]:
    """Each runner by name: ours (spark_runner.run and the drop-in) and PySpark's, each
    with a function and with the file."""
    from pyspark.ml.torch.distributor import TorchDistributor as Theirs

    def ours_fn() -> object:
        return spark_runner.run(one_allreduce, num_proc=2, verbose=0)

    def ours_file() -> object:
        return spark_runner.run(script, num_proc=2, verbose=0)

    def drop_in(program: Any) -> object:
        distributor = spark_runner.TorchDistributor(2, local_mode=False, use_gpu=False)
        return distributor.run(program)

    return {
        "spark_runner.run": ours_fn,
        "TorchDistributor.run": lambda: Theirs(2, local_mode=False, use_gpu=False).run(
            one_allreduce
        ),
        "spark_runner.TorchDistributor.run": lambda: drop_in(one_allreduce),
        "spark_runner.run (file)": ours_file,
        "TorchDistributor.run (file)": lambda: Theirs(2, local_mode=False, use_gpu=False).run(
            script
        ),
        "spark_runner.TorchDistributor.run (file)": lambda: drop_in(script),
    }


#: each of ours against PySpark's of the same form
VERSUS = {
    "spark_runner.run": "TorchDistributor.run",
    "spark_runner.TorchDistributor.run": "TorchDistributor.run",
    "spark_runner.run (file)": "TorchDistributor.run (file)",
    "spark_runner.TorchDistributor.run (file)": "TorchDistributor.run (file)",
}
EXPECTED: dict[str, object] = {
    "spark_runner.run": [3.0, 3.0],
    "TorchDistributor.run": 3.0,
    "spark_runner.TorchDistributor.run": 3.0,
    "spark_runner.run (file)": [None, None],
    "TorchDistributor.run (file)": None,
    "spark_runner.TorchDistributor.run (file)": None,
}


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
    peers = _peers(_script())
    expected = EXPECTED
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
    ratios = {o: summaries[o]["median"] / summaries[t]["median"] for o, t in VERSUS.items()}
    ratio = ratios["spark_runner.run"]
    cold_ratio = cold["spark_runner.run"] / cold["TorchDistributor.run"]
    checks = [
        _common.check(
            f"{name} returned {expected[name]} every call (the files: exit 0 on the right sum)",
            all(r == expected[name] for r in results[name]),
            f"{len(results[name])} calls",
        )
        for name in peers
    ]
    targets = [
        _common.target(
            f"launch + one allreduce on 2 tasks, warm: {o} <= 1.0x {VERSUS[o]}",
            r,
            1.0,
            lower_is_better=True,
            why_missed="not profiled in this run",
        )
        for o, r in ratios.items()
    ]
    t = _common.table(
        ["runner", "cold s (first call)", "warm s, median (min-max)", "ours / theirs (warm)"],
        [
            [
                name,
                f"{cold[name]:.2f}",
                _common.spread(s, fmt="{:.2f}"),
                f"{ratios[name]:.3g}" if name in ratios else "",
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
            "ratios_median": ratios,
            "targets": targets,
            "checks": checks,
            "table": t,
        },
        quick=opts.quick,
        rounds=rounds,
    )


if __name__ == "__main__":
    main()
