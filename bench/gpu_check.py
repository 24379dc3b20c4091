"""The device check of the GPU path, in one run of a few minutes (called by gpu_check.sh).

1. runs the GPU tests: with CUDA, ``pytest -m gpu`` on ``tests/test_gpu.py`` (size-1
   NCCL ring, CUDA tensors through Gloo across 2 processes sharing the GPU, training
   steps) and ``tests/test_gpu_runners.py`` (``RingEstimator(use_gpu=True)`` fit and
   transform on Spark ``local[1]``, ``RingTrainer`` / ``RayExecutor`` with ``use_gpu``
   on a local Ray); without CUDA both files whole (their CPU-side tests run, the ``gpu``
   ones skip);
2. allreduce of 1 MB .. 1 GB, ours (``ringcore.torch.allreduce_``) against raw
   ``torch.distributed.all_reduce`` on a group of the same backend, alternating the
   two in 3 rounds and taking medians; target: ours >= 0.95x raw;
3. training samples/s, ours (``DistributedOptimizer``) against DDP, same model/data.

With one GPU the rings are: a size-1 NCCL ring (``RING_BACKEND=nccl``), and two
processes sharing the GPU — NCCL refuses two ranks on one device, so there CUDA
tensors go through Gloo (ours copies them to host memory and back; raw Gloo does its
own staging). Without a GPU it measures the same on CPU tensors over Gloo (2 ranks)
and says so in the report (``gpu_found: false``).

The whole run keeps to ``--budget-s`` (default 280 s, under gpu_check.sh's 290 s
limit): the tests get at most 170 s, and a benchmark configuration that no longer fits
in what is left is skipped and says so in the report.

Writes JSON to ``$OUT/gpu_check.json`` when ``OUT`` is set, else
``bench/results/gpu_check.json``. Usage: python bench/gpu_check.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import re
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ringcore.testing import run_workers  # noqa: E402

MB = 1 << 20
TARGET = 0.95
TEST_FILES = ["tests/test_gpu.py", "tests/test_gpu_runners.py"]
TESTS_MAX_S = 170.0  # Spark and Ray start-up (~30 s each on a GPU host) + the GPU tests
CONFIG_MIN_S = 45.0  # a benchmark configuration needs about this much to be worth starting


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _reps(nbytes: int) -> int:
    return 20 if nbytes <= MB else 8 if nbytes <= 16 * MB else 3


def _timed(fn, reps: int, dev, barrier) -> float:
    """Median seconds of one call, each call started together on every rank."""
    fn()  # warm-up
    samples = []
    for _ in range(reps):
        _sync(dev)
        barrier()
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _allreduce_rows(sizes: list[int], dev, raw_group) -> list[dict]:
    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd

    def barrier() -> None:
        dist.barrier(group=raw_group)

    rows = []
    for nbytes in sizes:
        t = torch.ones(nbytes // 4, dtype=torch.float32, device=dev)
        reps = _reps(nbytes)
        name = f"bench.allreduce.{nbytes}"

        def raw_op(t=t) -> None:
            dist.all_reduce(t, group=raw_group)

        def our_op(t=t, name=name) -> None:
            hvd.allreduce_(t, op=hvd.Sum, name=name)

        raws, ourss = [], []
        for _ in range(3):  # alternating rounds: a noisy moment hits both
            raws.append(_timed(raw_op, reps, dev, barrier))
            ourss.append(_timed(our_op, reps, dev, barrier))
        best_raw, best_ours = statistics.median(raws), statistics.median(ourss)
        rows.append(
            {
                "bytes": nbytes,
                "raw_ms": round(best_raw * 1e3, 3),
                "ours_ms": round(best_ours * 1e3, 3),
                "ratio": round(best_raw / best_ours, 3),
            }
        )
        del t
    return rows


def _model(dev):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(784, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    ).to(dev)


def _train(model, opt, dev, steps: int, batch: int, barrier) -> float:
    import torch

    x = torch.randn(batch, 784, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)

    def step() -> None:
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    for _ in range(3):
        step()
    _sync(dev)
    barrier()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(dev)
    return steps * batch / (time.perf_counter() - t0)


def _training_row(dev, raw_group, steps: int, batch: int) -> dict:
    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd

    def barrier() -> None:
        dist.barrier(group=raw_group)

    model = _model(dev)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    ours = _train(model, opt, dev, steps, batch, barrier)
    ddp_model = torch.nn.parallel.DistributedDataParallel(
        _model(dev),
        device_ids=[dev.index] if dev.type == "cuda" else None,
        process_group=raw_group,
    )
    ddp = _train(
        ddp_model, torch.optim.SGD(ddp_model.parameters(), lr=0.01), dev, steps, batch, barrier
    )
    return {
        "samples_per_s_per_rank_ours": round(ours, 1),
        "samples_per_s_per_rank_ddp": round(ddp, 1),
        "ratio": round(ours / ddp, 3),
        "batch_per_rank": batch,
        "steps": steps,
    }


def _worker(sizes: list[int], use_cuda: bool, steps: int, batch: int) -> dict:
    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd
    from ringcore.launch import backend_name, pin_gpu

    torch.set_num_threads(1)
    hvd.init()
    try:
        dev = pin_gpu() if use_cuda else torch.device("cpu")
        raw_group = dist.new_group(list(range(hvd.size())))  # same backend, kept apart
        result = {
            "backend": backend_name(),
            "process_group": str(dist.get_backend_config()),
            "device": str(dev),
            "size": hvd.size(),
            "allreduce": _allreduce_rows(sizes, dev, raw_group),
            "training": _training_row(dev, raw_group, steps, batch),
        }
        dist.barrier(group=raw_group)
        return result
    finally:
        hvd.shutdown()


def _run_tests(timeout_s: float, gpu: bool) -> dict:
    """With a GPU only the ``gpu`` tests (CI runs the rest); without, both files whole.
    On a GPU machine, no ``gpu`` test passing counts as a failure (all skipped)."""
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *TEST_FILES]
    if gpu:
        cmd += ["-m", "gpu"]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"timed out after {timeout_s:.0f} s", "wall_s": timeout_s}
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    summary = lines[-1] if lines else proc.stderr[-500:]
    found = re.findall(r"(\d+) (passed|failed|skipped|deselected|errors?)", summary)
    counts = {k: int(v) for v, k in found}
    ok = proc.returncode == 0 and (not gpu or counts.get("passed", 0) > 0)
    return {
        "ok": ok,
        "command": " ".join(cmd[2:]),
        "summary": summary.strip("= "),
        "counts": counts,
        "skipped": [ln for ln in lines if ln.startswith("SKIPPED")][:20],
        "wall_s": round(time.perf_counter() - t0, 1),
        "tail": "\n".join(lines[-15:]) if not ok else "",
    }


def _device_facts() -> dict:
    import torch
    import torch.distributed as dist

    has_cuda = torch.cuda.is_available()
    return {
        "gpu_found": has_cuda,
        "gpu": torch.cuda.get_device_name(0) if has_cuda else None,
        "gpu_count": torch.cuda.device_count() if has_cuda else 0,
        "nccl_available": bool(dist.is_nccl_available()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_avg_1m_at_start": round(os.getloadavg()[0], 2),  # a busy host makes noise
    }


def _configs(facts: dict, quick: bool) -> list[dict]:
    if not facts["gpu_found"]:
        sizes = [1 * MB, 4 * MB, 16 * MB] if quick else [1 * MB, 4 * MB, 16 * MB, 64 * MB]
        return [
            {
                "name": "cpu-gloo-2ranks",
                "np": 2,
                "env": {"RING_BACKEND": "gloo"},
                "cuda": False,
                "sizes": sizes,
                "steps": 5 if quick else 10,
                "batch": 32,
                "why": "no GPU found: CPU tensors over Gloo, 2 ranks on this host",
            }
        ]
    big = [1 * MB, 16 * MB, 64 * MB, 256 * MB, 1024 * MB]
    first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0]
    configs = []
    if facts["nccl_available"]:
        configs.append(
            {
                "name": "cuda-nccl-size1",
                "np": 1,
                "env": {"RING_BACKEND": "nccl", "CUDA_VISIBLE_DEVICES": first},
                "cuda": True,
                "sizes": big[:3] if quick else big,
                "steps": 30,
                "batch": 256,
                "why": "one GPU: a size-1 NCCL ring",
            }
        )
    configs.append(
        {
            "name": "cuda-gloo-2ranks-shared-gpu",
            "np": 2,
            "env": {"CUDA_VISIBLE_DEVICES": first},  # unset RING_BACKEND: init() sees the sharing
            "cuda": True,
            "sizes": big[:2] if quick else big[:4],
            "steps": 20,
            "batch": 256,
            "why": (
                "two ranks share one GPU: NCCL refuses two ranks on one device, so CUDA tensors "
                "travel through Gloo (ours: copied to host memory and back; raw: Gloo's own staging)"
            ),
        }
    )
    return configs


def _targets(runs: list[dict]) -> list[dict]:
    out = []
    for run in runs:
        for row in run.get("allreduce", []):
            if row["ratio"] < TARGET:
                out.append(
                    {
                        "config": run["name"],
                        "bytes": row["bytes"],
                        "ratio": row["ratio"],
                        "target": TARGET,
                        "why": (
                            "small ops: ours pays Python-side negotiation with the coordinator "
                            "(a TCP round trip per op) that raw all_reduce does not"
                            if row["bytes"] <= 4 * MB
                            else "missed at a size where the wire dominates: timing noise on a "
                            "shared machine, or a real cost — rerun to tell"
                        ),
                    }
                )
    return out


def _print(report: dict) -> None:
    print(f"gpu_found={report['device']['gpu_found']}  {report['note']}")
    print(f"tests: {report['tests']['summary']}")
    for run in report["runs"]:
        if "skipped" in run:
            print(f"[{run['name']}] {run['skipped']}")
            continue
        if "error" in run:
            print(f"[{run['name']}] FAILED: {run['error'][:300]}")
            continue
        print(f"[{run['name']}] backend={run['backend']} device={run['device']} size={run['size']}")
        print(f"  {'bytes':>12} {'raw ms':>10} {'ours ms':>10} {'ours/raw':>9}")
        for row in run["allreduce"]:
            print(
                f"  {row['bytes']:>12} {row['raw_ms']:>10.3f} {row['ours_ms']:>10.3f} "
                f"{row['ratio']:>9.3f}"
            )
        tr = run["training"]
        print(
            f"  training samples/s per rank: ours {tr['samples_per_s_per_rank_ours']}, "
            f"DDP {tr['samples_per_s_per_rank_ddp']} (ratio {tr['ratio']})"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and steps")
    parser.add_argument("--skip-tests", action="store_true")
    parser.add_argument(
        "--budget-s", type=float, default=280.0, help="wall-clock budget of the whole run"
    )
    args = parser.parse_args()
    t0 = time.perf_counter()
    deadline = t0 + args.budget_s
    facts = _device_facts()
    tests = (
        {"ok": True, "summary": "skipped (--skip-tests)"}
        if args.skip_tests
        else _run_tests(min(TESTS_MAX_S, args.budget_s - 90.0), gpu=facts["gpu_found"])
    )
    runs = []
    for conf in _configs(facts, args.quick):
        row = {"name": conf["name"], "why": conf["why"], "np": conf["np"]}
        left = deadline - time.perf_counter()
        if left < CONFIG_MIN_S:
            row["skipped"] = f"not run: {left:.0f} s of the {args.budget_s:.0f} s budget left"
            runs.append(row)
            continue
        try:
            results = run_workers(
                _worker,
                np=conf["np"],
                args=(conf["sizes"], conf["cuda"], conf["steps"], conf["batch"]),
                env=conf["env"],
                timeout=min(240.0, left - 5.0),
            )
            row.update(results[0])
            row["training_per_rank"] = [r["training"] for r in results]
        except Exception as exc:  # the report says what failed; the exit code too
            row["error"] = f"{type(exc).__name__}: {exc}"
        runs.append(row)
    note = (
        f"GPU found: {facts['gpu']} x{facts['gpu_count']}"
        if facts["gpu_found"]
        else "NO GPU FOUND: these are CPU-only results (CPU tensors over Gloo); "
        "the CUDA/NCCL paths were not exercised and their tests skipped"
    )
    report = {
        "name": "gpu_check",
        "note": note,
        "device": facts,
        "tests": tests,
        "runs": runs,
        "target": f"ours >= {TARGET}x raw torch.distributed all_reduce at every size",
        "missed_targets": _targets(runs),
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    out_dir = (
        pathlib.Path(os.environ["OUT"]) if os.environ.get("OUT") else ROOT / "bench" / "results"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    _print(report)
    print(f"wrote {path} in {report['wall_s']} s")
    ok = tests["ok"] and all("error" not in r for r in runs)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
