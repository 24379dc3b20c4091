"""Soak: elastic training with random faults, round after round, for a while (``make soak``).

Each round starts an elastic job of ``--np`` ranks on this machine
(``ringcore.testing.run_workers(elastic=True)``, real Gloo over 127.0.0.1). Every rank
trains a small model over an ``ElasticSampler``; one rank, drawn at random, meets a fault
drawn at random at a random step:

- ``sigkill``: the process is SIGKILLed (a crash, the OOM killer);
- ``raise``: it raises inside the training step (a bug in user code on one rank);
- ``none``: a round without a fault, as a control.

A round passes when the survivors finish every epoch with every sample trained exactly
once per epoch (checked from the committed state), on one rank fewer after a fault, and
the failed rank is reported as the launcher's error of that worker. Anything else — a
hang past ``--round-timeout``, a wrong count, a survivor that failed — is a failure, kept
with its traceback. Prints a table and writes ``bench/results/soak.json``. Not part of
``make test`` (it is meant to run for half an hour). Usage:

    python tools/soak.py [--minutes 30] [--np 3] [--seed 1]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import random
import statistics
import sys
import time
import traceback

from ringcore import WorkerError
from ringcore.testing import run_workers

N, BATCH, EPOCHS = 48, 4, 2
FAULTS = ("sigkill", "raise", "none")
RESULTS = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results" / "soak.json"


def _worker(victim: int, fault: str, at_step: int):
    import os
    import signal
    import time

    import torch

    import ringcore.torch as hvd
    from ringcore.torch import elastic

    hvd.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = hvd.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), named_parameters=model.named_parameters()
    )
    sampler = elastic.ElasticSampler(N, shuffle=True, seed=1)
    state = elastic.TorchState(model, opt, sampler=sampler, epoch=0, counts=[], steps=0, sizes=[])
    data = torch.arange(N, dtype=torch.float32).view(-1, 1).repeat(1, 3)
    me = os.environ["RING_WORKER_ID"]

    @elastic.run
    def train(state):
        state.sizes.append(hvd.size())
        while state.epoch < EPOCHS:
            indices = list(state.sampler)
            for b in range(0, len(indices), BATCH):
                chunk = indices[b : b + BATCH]
                opt.zero_grad()
                model(data[chunk]).sum().backward()
                opt.step()
                n = int(hvd.allreduce(torch.tensor([len(chunk)]), op=hvd.Sum, name="n").item())
                state.steps += 1
                if state.steps == at_step and me == str(victim):
                    if fault == "sigkill":
                        os.kill(os.getpid(), signal.SIGKILL)
                    if fault == "raise":
                        raise RuntimeError("soak: a fault in user code on one rank")
                state.counts.append((state.epoch, n))
                state.sampler.record_indices(chunk)
                time.sleep(0.01)
                state.commit()
            hvd.join()
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            state.commit()
        return state.counts, state.sizes

    return train(state)


def _check(results: list, np: int, victim: int, fault: str) -> str | None:
    """Why the round is wrong, or None when it is right."""
    faulted = fault != "none"
    for i, res in enumerate(results):
        if faulted and i == victim:
            if not isinstance(res, WorkerError):
                return f"the victim (worker {i}) returned instead of failing"
            continue
        if isinstance(res, Exception):
            return f"worker {i} failed: {res}"
        counts, sizes = res
        for epoch in range(EPOCHS):
            total = sum(n for e, n in counts if e == epoch)
            if total != N:
                return f"worker {i}: epoch {epoch} trained {total} samples, not {N}"
        want = [np, np - 1] if faulted else [np]
        if sizes[0] != np or sizes[-1] != want[-1]:
            return (
                f"worker {i}: ring sizes {sizes}, expected to start at {np} and end at {want[-1]}"
            )
    return None


def _round(rng: random.Random, np: int, timeout: float) -> dict:
    fault = rng.choice(FAULTS)
    victim = rng.randrange(np)
    at_step = rng.randint(2, 2 * N // (BATCH * np))
    started = time.monotonic()
    try:
        results = run_workers(
            _worker, np=np, args=(victim, fault, at_step), timeout=timeout, elastic=True
        )
        problem = _check(results, np, victim, fault)
    except Exception:
        problem = traceback.format_exc(limit=3)
    return {
        "fault": fault,
        "victim": victim,
        "at_step": at_step,
        "seconds": round(time.monotonic() - started, 2),
        "ok": problem is None,
        "problem": problem,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--np", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--round-timeout", type=float, default=180.0)
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    deadline = time.monotonic() + args.minutes * 60
    rounds: list[dict] = []
    while time.monotonic() < deadline:
        rounds.append(_round(rng, args.np, args.round_timeout))
        r = rounds[-1]
        status = "ok" if r["ok"] else "FAILED"
        print(
            f"round {len(rounds):3d}: {r['fault']:7s} worker {r['victim']} at step "
            f"{r['at_step']:2d}: {status} in {r['seconds']:.1f} s",
            flush=True,
        )
        if not r["ok"]:
            print("  " + str(r["problem"]).replace("\n", "\n  "), flush=True)
    print(f"\n{'fault':8s} {'rounds':>7s} {'passed':>7s} {'median s':>9s}")
    summary = {}
    for fault in FAULTS:
        mine = [r for r in rounds if r["fault"] == fault]
        if not mine:
            continue
        passed = sum(r["ok"] for r in mine)
        median = statistics.median(r["seconds"] for r in mine)
        summary[fault] = {"rounds": len(mine), "passed": passed, "median_s": median}
        print(f"{fault:8s} {len(mine):7d} {passed:7d} {median:9.1f}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "minutes": args.minutes,
                "np": args.np,
                "seed": args.seed,
                "machine": f"{platform.system()} {platform.machine()}, Python "
                f"{platform.python_version()}",
                "summary": summary,
                "rounds": rounds,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")
    return 0 if all(r["ok"] for r in rounds) else 1


if __name__ == "__main__":
    sys.exit(main())
