"""Run Horovod's own parallel test suites against ringcore and write docs/conformance.md.

    python tools/conformance.py --horovod-src DIR [--suite test_torch.py ...] [-k EXPR]

``DIR`` is a Horovod checkout or a bare git directory of one (``git show HEAD:path``
reads it then). Nothing of Horovod is copied into this repository: the suites and their
helpers are written to a temporary folder for the run, beside a shim package named
``horovod`` whose modules re-export ringcore's bindings (``horovod.torch`` ->
``ringcore.torch`` and so on) plus the few harness helpers Horovod's tests import
(``tools/horovod_shim.py``). The page's section on Horovod's examples is written by
``tools/examples.py``; this tool keeps it as it is.

Each test runs in its own launch of ``--np`` ranks (as ``horovodrun -np 2 --gloo`` would
start them: ``HOROVOD_RANK``/``HOROVOD_SIZE``/... and a store on 127.0.0.1), so a test that
leaves the ranks out of step cannot take the rest with it; a launch that outlives
``--timeout`` is killed and reported as a hang. The result of a test is the worst of its
ranks' (failed > hang > passed > skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path

from horovod_shim import SHIM, write_shim

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SUITES = (
    "test_torch.py",
    "test_timeline.py",
    "test_tensorflow.py",
    "test_tensorflow2_keras.py",
)
# tools/examples.py's section of docs/conformance.md (this tool keeps it as it is).
EXAMPLES_BEGIN, EXAMPLES_END = "<!-- examples:begin -->", "<!-- examples:end -->"
# Support files every suite may import (test/utils is put on sys.path by test/conftest.py).
SUPPORT = ("test/conftest.py", "test/utils/common.py", "test/parallel/base_test_tensorflow.py")
# Tests whose failure is the test's own problem, not ringcore's, with the reason. Only
# entries measured and explained belong here; docs/conformance.md lists them.
_MUON = (
    "not ours: the test sweeps every torch.optim.Optimizer subclass, and torch.optim.Muon "
    "(newer than the test; torch 2.13 here) rejects the test model's 1-D bias (\"Muon only "
    'supports 2D parameters"); with Muon left out of the sweep the test passes on ringcore'
)
_K3_AGG_OPTIMIZER = (
    "Keras 3: the test's own TestingOptimizer calls Optimizer.__init__(name=...) without the "
    "learning_rate Keras 3 requires (TypeError before horovod is called), its update_step "
    "lacks Keras 3's learning_rate argument, and it reads Horovod's private _agg_helper"
)
_K3_NO_REF = (
    "Keras 3: the test calls var.ref() on model.trainable_weights, and Keras 3 variables "
    "have no ref() (AttributeError in the test after our op returned)"
)
KNOWN_NOT_OURS: dict[str, str] = {
    # test_tensorflow2_keras.py and test_tensorflow.py (TensorFlow 2.21 with Keras 3)
    "test_sparse_as_dense": (
        "Keras 3: keras.optimizers.RMSprop(lr=...) is rejected (the lr alias is gone: "
        "'Argument(s) not recognized') on the test's first line, before horovod is called"
    ),
    "test_sparse_as_dense_with_grad_aggregation": (
        "Keras 3: RMSprop(lr=...) is rejected on the test's first line; the test also reads "
        "Horovod's private _agg_helper.counter"
    ),
    "test_legacy_optimizer": (
        "Keras 3: keras.optimizers.legacy is not supported (ImportError on use) in the test"
    ),
    "test_train_model_lr_schedule": (
        "Keras 3: the test uses keras.losses.mean_squared_error, keras.layers.ThresholdedReLU, "
        "optimizer.lr and compile(experimental_run_tf_function=...), all removed"
    ),
    "test_gradient_aggregation_0": _K3_AGG_OPTIMIZER,
    "test_gradient_aggregation_1": _K3_AGG_OPTIMIZER,
    "test_gradient_aggregation_with_local_vars_0": _K3_AGG_OPTIMIZER,
    "test_gradient_aggregation_with_local_vars_1": _K3_AGG_OPTIMIZER,
    "test_partial_distributed_optimizer": _K3_NO_REF,
    "test_broadcast_global_variables_callback_with_local_vars": (
        "Keras 3: after model.fit (which ran with our callback), the test calls var.ref() on "
        "the layer's variables, and Keras 3 variables have no ref()"
    ),
    "test_partial_distributed_gradient_tape": _K3_NO_REF,
    "test_horovod_syncbn_cpu": (
        "Keras 3: the test's reference tf.keras.layers.BatchNormalization(fused=False) is "
        "rejected ('Unrecognized keyword arguments') before our SyncBatchNormalization "
        "runs (tests/ringcore/test_keras.py compares ours with BatchNormalization on the whole batch)"
    ),
    "test_broadcast_state": _MUON,
    "test_broadcast_state_options": _MUON,
    "test_force_allreduce": _MUON,
}

# Failures of ours whose cause is measured: still counted as failed, the reason shown
# instead of the first line of the traceback. (None today: the graph-mode error class
# of test_tensorflow.py was the last, fixed in ringcore/tensorflow/_bridge.py.)
EXPLAINED: dict[str, str] = {}


@dataclass
class Outcome:
    suite: str
    test: str
    result: str  # passed | failed | skipped | hang
    reason: str
    seconds: float


def read_source(src: Path, rel: str) -> str | None:
    """One file of Horovod's source, from a checkout or a (bare) git directory."""
    if (src / rel).is_file():
        return (src / rel).read_text()
    git = ["git", "-C", str(src), "show", f"HEAD:{rel}"]
    done = subprocess.run(git, capture_output=True, text=True)
    return done.stdout if done.returncode == 0 else None


def materialize(src: Path, work: Path, suites: list[str]) -> None:
    for rel in (*SUPPORT, *(f"test/parallel/{s}" for s in suites)):
        text = read_source(src, rel)
        if text is None:
            if rel.startswith("test/parallel/test_"):
                raise SystemExit(f"{rel} is not in {src}: is HOROVOD_SRC a Horovod checkout?")
            continue
        (work / rel).parent.mkdir(parents=True, exist_ok=True)
        (work / rel).write_text(text)
    write_shim(work / "shim", SHIM)


def base_env(work: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RING_", "HOROVOD_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(work / "shim"), str(ROOT)])
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def collect(work: Path, suite: str, keyword: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
    if keyword:
        cmd += ["-k", keyword]
    done = subprocess.run(
        [*cmd, suite],
        cwd=work / "test" / "parallel",
        env=base_env(work),
        capture_output=True,
        text=True,
    )
    ids = [line.strip() for line in done.stdout.splitlines() if "::" in line]
    if not ids and done.returncode not in (0, 5):
        raise SystemExit(f"collecting {suite} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return ids


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(work: Path, rank: int, size: int, port: int) -> dict[str, str]:
    env = base_env(work)
    env.update(
        HOROVOD_RANK=str(rank),
        HOROVOD_SIZE=str(size),
        HOROVOD_LOCAL_RANK=str(rank),
        HOROVOD_LOCAL_SIZE=str(size),
        HOROVOD_CROSS_RANK="0",
        HOROVOD_CROSS_SIZE="1",
        HOROVOD_HOSTNAME="localhost",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    return env


def junit_outcome(path: Path) -> tuple[str, str]:
    """(passed|failed|skipped, reason) of the one test case in a JUnit file."""
    if not path.exists():
        return "failed", "the rank wrote no report (crashed before pytest finished)"
    case = ET.parse(path).getroot().find(".//testcase")
    if case is None:
        return "failed", "no test case in the report (collection error)"
    for kind in ("failure", "error"):
        node = case.find(kind)
        if node is not None:
            return "failed", first_line(node.get("message") or node.text or kind)
    node = case.find("skipped")
    if node is not None:
        return "skipped", first_line(node.get("message") or "skipped")
    return "passed", ""


def first_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return (lines[0] if lines else "")[:300]


def run_one(work: Path, suite: str, test: str, np_: int, timeout: float) -> Outcome:
    port = free_port()
    reports = work / "reports"
    reports.mkdir(exist_ok=True)
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(np_):
        xml = reports / f"r{rank}.xml"
        xml.unlink(missing_ok=True)
        log = open(reports / f"r{rank}.log", "w+")  # noqa: SIM115 - closed below
        logs.append(log)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x"]
        procs.append(
            subprocess.Popen(
                [*cmd, f"--junitxml={xml}", test],
                cwd=work / "test" / "parallel",
                env=rank_env(work, rank, np_, port),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
    hung = False
    deadline = start + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            hung = True
            break
    if hung:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    seconds = time.monotonic() - start
    outcomes = [junit_outcome(reports / f"r{r}.xml") for r in range(np_)]
    tails = []
    for log in logs:
        log.seek(0)
        tails.append(log.read()[-4000:])
        log.close()
    if any(o[0] == "failed" and "wrote no report" not in o[1] for o in outcomes):
        rank, (_, reason) = next((r, o) for r, o in enumerate(outcomes) if o[0] == "failed")
        return Outcome(suite, test, "failed", f"rank {rank}: {reason}", seconds)
    if hung:
        alive = [r for r, p in enumerate(outcomes) if p[1].startswith("the rank wrote no")]
        return Outcome(
            suite, test, "hang", f"ranks {alive} still running after {timeout:.0f} s", seconds
        )
    if any(o[0] == "failed" for o in outcomes):
        rank = next(r for r, o in enumerate(outcomes) if o[0] == "failed")
        crash = first_line(tails[rank].strip().splitlines()[-1] if tails[rank].strip() else "")
        return Outcome(
            suite, test, "failed", f"rank {rank} exited {procs[rank].returncode}: {crash}", seconds
        )
    if all(o[0] == "skipped" for o in outcomes):
        return Outcome(suite, test, "skipped", outcomes[0][1], seconds)
    return Outcome(suite, test, "passed", "", seconds)


def not_ours(o: Outcome) -> bool:
    """A failure measured and explained as the test's own (KNOWN_NOT_OURS)."""
    return o.result == "failed" and o.test.split("::")[-1] in KNOWN_NOT_OURS


def write_markdown(path: Path, outcomes: list[Outcome], meta: dict[str, str]) -> None:
    suites = sorted({o.suite for o in outcomes}, key=lambda s: (*DEFAULT_SUITES, s).index(s))
    lines = [
        "# Horovod conformance",
        "",
        "Horovod's own parallel test suites run against ringcore through a shim package named",
        "`horovod` (`make conformance HOROVOD_SRC=<a Horovod checkout or git dir>`; this page",
        "is written by `tools/conformance.py`, not by hand). Each test is its own launch of "
        f"{meta['np']}",
        "Gloo ranks on one host, as `horovodrun -np 2 --gloo` starts them. GPU-only and",
        "MPI-only tests skip. *Not ours* counts failures inside the test's own code on",
        "today's frameworks (a test written for Keras 2 or an older torch), each with its",
        "reason below. Horovod's examples, run unchanged, are the last section (written by",
        "`tools/examples.py`).",
        "",
        f"Horovod source: commit `{meta['horovod_commit']}`. ringtrain: "
        + (meta["runs"] if "runs" in meta else f"commit `{meta['ringtrain_commit']}`")
        + f". Run {meta['date']}, torch {meta['torch']}, tensorflow {meta['tensorflow']}, "
        f"keras {meta['keras']}.",
        "",
        "| suite | tests | passed | failed | not ours | hang | skipped |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for suite in suites:
        mine = [o for o in outcomes if o.suite == suite]
        passed = sum(o.result == "passed" for o in mine)
        theirs = sum(not_ours(o) for o in mine)
        failed = sum(o.result == "failed" for o in mine) - theirs
        hang = sum(o.result == "hang" for o in mine)
        skipped = sum(o.result == "skipped" for o in mine)
        lines.append(
            f"| {suite} | {len(mine)} | {passed} | {failed} | {theirs} | {hang} | {skipped} |"
        )
    for suite in suites:
        bad = [o for o in outcomes if o.suite == suite and o.result != "passed"]
        if not bad:
            continue
        lines += ["", f"## {suite}: every test that did not pass", ""]
        lines += ["| test | result | reason |", "|---|---|---|"]
        for o in sorted(bad, key=lambda o: ("skipped", "failed", "hang").index(o.result) * -1):
            name = o.test.split("::")[-1]
            result = "not ours" if not_ours(o) else o.result
            explained = EXPLAINED.get(name, o.reason) if o.result == "failed" else o.reason
            reason = (KNOWN_NOT_OURS[name] if not_ours(o) else explained).replace("|", "\\|")
            lines.append(f"| `{name}` | {result} | {reason} |")
    path.write_text("\n".join([*lines, *examples_section(path)]) + "\n")


def examples_section(page: Path) -> list[str]:
    """The section ``tools/examples.py`` wrote in ``page`` (kept when this tool rewrites
    the suites' part of the page), preceded by a blank line; none if there is none."""
    text = page.read_text() if page.exists() else ""
    if EXAMPLES_BEGIN not in text or EXAMPLES_END not in text:
        return []
    start, end = text.index(EXAMPLES_BEGIN), text.index(EXAMPLES_END) + len(EXAMPLES_END)
    return ["", text[start:end]]


def report(paths: list[Path], out: Path) -> None:
    """docs/conformance.md from the JSON of one or more runs (e.g. one per suite). A later
    run's result for a test replaces an earlier one's (a rerun of a few tests after a
    fix), and the page names the ringtrain commit of every run merged."""
    by_test: dict[tuple[str, str], Outcome] = {}
    meta: dict[str, str] = {}
    runs: list[str] = []
    for p in paths:
        data = json.loads(p.read_text())
        meta = meta or dict(data["meta"])
        tests = [Outcome(**t) for t in data["tests"]]
        commit = data["meta"]["ringtrain_commit"]
        replaced = sum((o.suite, o.test) in by_test for o in tests)
        if replaced:
            runs.append(f"{replaced} tests rerun at `{commit}`, replacing their results")
        else:
            suites = ", ".join(sorted({o.suite for o in tests}))
            runs.append(f"{suites} at `{commit}`")
        by_test.update({(o.suite, o.test): o for o in tests})
    if len(paths) > 1:
        meta["runs"] = "; ".join(runs)
    write_markdown(out, list(by_test.values()), meta)
    print(f"wrote {out}")


def horovod_commit(src: Path) -> str:
    done = subprocess.run(
        ["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True
    )
    return done.stdout.strip() or "unknown"


def versions() -> dict[str, str]:
    code = (
        "import importlib.metadata as m, json\n"
        "out = {}\n"
        "for n in ('torch', 'tensorflow-cpu', 'keras'):\n"
        "    try: out[n.split('-')[0]] = m.version(n)\n"
        "    except Exception: out[n.split('-')[0]] = 'absent'\n"
        "print(json.dumps(out))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    return dict(json.loads(done.stdout))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--horovod-src", type=Path)
    parser.add_argument(
        "--report", nargs="+", type=Path, help="write --out from these JSON results and stop"
    )
    parser.add_argument("--suite", action="append", help="a file of test/parallel (repeatable)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression to select tests")
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds per test launch")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "conformance.md")
    parser.add_argument("--json", type=Path, default=ROOT / "build" / "conformance.json")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    if args.report:
        report(args.report, args.out)
        return 0
    if args.horovod_src is None:
        parser.error("--horovod-src is required (a Horovod checkout or its git directory)")
    suites = args.suite or list(DEFAULT_SUITES)
    work = Path(tempfile.mkdtemp(prefix="ringtrain-conformance-"))
    outcomes: list[Outcome] = []
    try:
        materialize(args.horovod_src, work, suites)
        for suite in suites:
            tests = collect(work, suite, args.keyword)
            print(f"{suite}: {len(tests)} tests", flush=True)
            for i, test in enumerate(tests, 1):
                out = run_one(work, suite, test, args.np, args.timeout)
                outcomes.append(out)
                note = f" - {out.reason}" if out.reason else ""
                print(
                    f"[{i}/{len(tests)}] {out.result:7s} {out.seconds:5.1f}s {test}{note}",
                    flush=True,
                )
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    meta = {
        "np": str(args.np),
        "horovod_commit": horovod_commit(args.horovod_src),
        "ringtrain_commit": commit.stdout.strip() or "unknown",
        "date": time.strftime("%Y-%m-%d"),
        **versions(),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(
        json.dumps({"meta": meta, "tests": [asdict(o) for o in outcomes]}, indent=1)
    )
    if args.keyword is None and args.suite is None:
        write_markdown(args.out, outcomes, meta)
        print(f"wrote {args.out}")
    bad = [o for o in outcomes if o.result == "hang" or (o.result == "failed" and not not_ours(o))]
    print(
        f"{sum(o.result == 'passed' for o in outcomes)} passed, {len(bad)} failed, "
        f"{sum(o.result == 'skipped' for o in outcomes)} skipped"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
