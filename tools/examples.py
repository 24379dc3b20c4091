"""Run Horovod's own examples, unchanged, against ringcore and record each result.

    python tools/examples.py --horovod-src DIR [--only NAME ...] [--timeout S]
    python tools/examples.py --report build/examples.json   # the page again, from a run

``DIR`` is a Horovod checkout or a bare git directory of one. Every example of
``examples/{tensorflow2,keras,pytorch,elastic,ray}`` (the table ``EXAMPLES``) is written
to a temporary folder with the ``horovod`` shim of ``tools/horovod_shim.py`` and run
there, one at a time, each in a folder of its own (its working directory and ``HOME``):

- ``horovodrun``: 2 ranks with the variables ``horovodrun -np 2 --gloo`` sets;
- ``ringrun``: the elastic examples, through ringtrain's own launcher in elastic mode:
  ``python -m ringrun --min-np 1 --max-np 2 --host-discovery-script S`` (``S`` prints
  ``localhost:2``), its output lines prefixed ``[worker]<stdout>:``;
- ``torchrun``: ``torchrun --standalone --nproc-per-node 2`` (none in the table now);
- ``ray``: the example is the driver of a local Ray (``num_cpus=2``) this tool starts.

No internet here: ``tools/example_standins`` is on the examples' ``PYTHONPATH`` (a
``sitecustomize`` that points ``keras.datasets.mnist.load_data`` at a small generated
MNIST file, and a ``torchvision`` with ``datasets.MNIST`` on that file, ``transforms``
and a small ``models.resnet50``). Each example's work is capped through its own
command-line flags where it has them (``Example.args``). The result of each goes to
``build/examples.json`` and to the examples section of ``docs/conformance.md``
(between ``<!-- examples:begin -->`` and ``<!-- examples:end -->``; the suites' part,
written by ``tools/conformance.py``, is left as it is). Not part of ``make test``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from conformance import (
    EXAMPLES_BEGIN,
    EXAMPLES_END,
    base_env,
    free_port,
    horovod_commit,
    rank_env,
    read_source,
)
from example_table import EXAMPLES, KNOWN, Example, Launch
from horovod_shim import EXAMPLES_SHIM, write_shim

ROOT = Path(__file__).resolve().parent.parent
STANDINS = Path(__file__).resolve().parent / "example_standins"
MNIST_ENV_VAR = "RINGTRAIN_EXAMPLES_MNIST"
BEGIN, END = EXAMPLES_BEGIN, EXAMPLES_END
NP = 2
# The innermost exception line of a traceback (TensorFlow indents the one of user code).
_EXCEPTION = re.compile(r"^\s*((?:[\w]+\.)*\w*(?:Error|Exception|Interrupt|Exit))(?::\s|$)")
# torch.distributed's prefix of a rank's traceback, and ringrun's of a worker's lines
_RANK_PREFIX = re.compile(r"^(?:\[\d+\]<std(?:out|err)>:)?(?:\[rank\d+\]:)?")
_PEER_LOST = ("RingInternalError", "HorovodInternalError", "ChildFailedError")


@dataclass
class Result:
    example: str
    launch: str
    args: list[str]
    result: str  # passed | failed | hang | not ours | not runnable here
    detail: str
    seconds: float


def materialize(src: Path, work: Path) -> None:
    """The examples' folders (siblings import each other), the shim, the MNIST stand-in."""
    for folder in sorted({str(Path(e.path).parent) for e in EXAMPLES}):
        for rel in _python_files(src, f"examples/{folder}"):
            text = read_source(src, rel)
            if text is not None:
                (work / rel).parent.mkdir(parents=True, exist_ok=True)
                (work / rel).write_text(text)
    missing = [e.path for e in EXAMPLES if not (work / "examples" / e.path).is_file()]
    if missing:
        raise SystemExit(f"{', '.join(missing)} not in {src}: is it a Horovod checkout?")
    write_shim(work / "shim", EXAMPLES_SHIM)
    write_mnist(work / "data" / "mnist.npz")


def _python_files(src: Path, folder: str) -> list[str]:
    """The ``.py`` files of ``folder`` in a checkout or a (bare) git directory."""
    if (src / folder).is_dir():
        return sorted(f"{folder}/{p.name}" for p in (src / folder).glob("*.py"))
    git = ["git", "-C", str(src), "ls-tree", "--name-only", "HEAD", f"{folder}/"]
    listing = subprocess.run(git, capture_output=True, text=True).stdout.split()
    return [rel for rel in listing if rel.endswith(".py")]


def write_mnist(path: Path, train: int = 512, test: int = 256) -> None:
    """MNIST's arrays (uint8 images 28x28, uint8 labels), with fewer rows: each label's
    images carry a bright square at a place of their own, so a model can learn them."""
    rng = np.random.default_rng(0)
    arrays = {}
    for part, rows in (("train", train), ("test", test)):
        labels = rng.integers(0, 10, rows).astype(np.uint8)
        images = rng.integers(0, 64, (rows, 28, 28)).astype(np.uint8)
        for i, label in enumerate(labels):
            top, left = 2 + 8 * (label // 4), 2 + 6 * (label % 4)
            images[i, top : top + 6, left : left + 6] = 255
        arrays[f"x_{part}"], arrays[f"y_{part}"] = images, labels
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)


def example_env(work: Path, home: Path) -> dict[str, str]:
    env = base_env(work)
    env["PYTHONPATH"] = os.pathsep.join([str(work / "shim"), str(STANDINS), str(ROOT)])
    env[MNIST_ENV_VAR] = str(work / "data" / "mnist.npz")
    env["HOME"] = str(home)  # FileLock("~/.horovod_lock"), ~/.keras: per example
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    return env


def error_line(text: str) -> str:
    """The last exception line of ``text`` (a rank's output), else its last line."""
    plain = [_RANK_PREFIX.sub("", ln) for ln in text.splitlines()]
    found = [ln.strip() for ln in plain if _EXCEPTION.match(ln)]
    mine = [ln for ln in found if not _peer_lost(ln)]
    lines = mine or found or [ln.strip() for ln in plain if ln.strip()]
    return (lines[-1] if lines else "no output")[:300]


def _peer_lost(line: str) -> bool:
    """Whether ``line`` is an exception that only echoes another rank's failure."""
    found = _EXCEPTION.match(line)
    return found is not None and found.group(1).split(".")[-1] in _PEER_LOST


_RAY_HEAD = """
import sys, ray
ray.init(num_cpus=int(sys.argv[1]), include_dashboard=False)
print("RAY_ADDRESS=" + ray.get_runtime_context().gcs_address, flush=True)
sys.stdin.read()
ray.shutdown()
"""


@contextlib.contextmanager
def ray_head(env: dict[str, str], cpus: int = 2) -> Iterator[str]:
    """A local Ray of ``cpus`` CPUs held by a process of ours; yields its address."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _RAY_HEAD, str(cpus)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        start_new_session=True,
    )
    assert proc.stdin is not None and proc.stdout is not None
    try:
        address = ""
        for line in proc.stdout:
            if line.startswith("RAY_ADDRESS="):
                address = line.strip().split("=", 1)[1]
                break
        if not address:
            raise SystemExit(f"the local Ray did not start (exit {proc.wait()})")
        yield address
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


_DISCOVER = f"#!/bin/sh\necho localhost:{NP}\n"


def _commands(ex: Example, script: Path, args: list[str], run: Path) -> list[list[str]]:
    if ex.launch is Launch.RINGRUN:
        discover = run / "discover_hosts.sh"
        discover.write_text(_DISCOVER)
        discover.chmod(0o755)
        elastic = ["--min-np", "1", "--max-np", str(NP), "--host-discovery-script", str(discover)]
        return [[sys.executable, "-m", "ringrun", *elastic, sys.executable, str(script), *args]]
    if ex.launch is Launch.TORCHRUN:
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        logs = ["--redirects", "3", "--log-dir", str(run / "torchrun")]
        return [[*torchrun, "--nproc-per-node", str(NP), *logs, str(script), *args]]
    count = NP if ex.launch is Launch.HOROVODRUN else 1
    return [[sys.executable, str(script), *args] for _ in range(count)]


def _wait(procs: list[subprocess.Popen], timeout: float) -> bool:
    """Wait for ``procs``; on ``timeout``, kill their process groups. True if they hung."""
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
        return False
    except subprocess.TimeoutExpired:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return True


def run_example(work: Path, ex: Example, timeout: float) -> Result:
    run = work / "runs" / Path(ex.path).stem
    run.mkdir(parents=True)
    env = example_env(work, run)
    with contextlib.ExitStack() as stack:
        address = ""
        if ex.launch is Launch.RAY:
            address = stack.enter_context(ray_head(env))
            env["RAY_ADDRESS"] = address
        args = [a.format(data=work / "data", address=address) for a in ex.args]
        port, procs, logs = free_port(), [], []
        start = time.monotonic()
        for rank, cmd in enumerate(_commands(ex, work / "examples" / ex.path, args, run)):
            log = stack.enter_context(open(run / f"out{rank}.log", "w+"))
            logs.append(log)
            procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=run,
                    env={**env, **_rank_vars(ex, rank, port)},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
        hung = _wait(procs, timeout)
        seconds = time.monotonic() - start
        outputs = [_read(log) for log in logs] + [
            p.read_text(errors="replace") for p in sorted(run.glob("torchrun/**/*.log"))
        ]
    # paths of this machine out of the error lines: the page is read elsewhere
    outputs = [t.replace(str(work), "$WORK").replace(f"{ROOT}/", "") for t in outputs]
    return _outcome(ex, procs, outputs, hung, seconds, timeout)


def _rank_vars(ex: Example, rank: int, port: int) -> dict[str, str]:
    """What ``horovodrun -np 2 --gloo`` sets for ``rank`` (the same as the suites get)."""
    if ex.launch is not Launch.HOROVODRUN:
        return {}
    env = rank_env(Path("."), rank, NP, port)
    return {k: v for k, v in env.items() if k.startswith(("HOROVOD_", "MASTER_"))}


def _read(log) -> str:
    log.seek(0)
    return str(log.read())


def _outcome(ex, procs, outputs, hung, seconds, timeout) -> Result:
    failed = [i for i, p in enumerate(procs) if p.returncode != 0]
    if hung:
        result, detail = "hang", f"still running after {timeout:.0f} s"
    elif not failed:
        result, detail = "passed", ""
    else:  # the first output with an error of its own (not "a peer was lost")
        first = [outputs[i] for i in failed if i < len(outputs)]  # a failed process's own
        errors = [error_line(text) for text in [*first, *outputs] if text.strip()]
        mine = [e for e in errors if _EXCEPTION.match(e) and not _peer_lost(e)]
        result, detail = "failed", (mine or errors or ["no output"])[0]
    known = KNOWN.get(ex.path)
    if known is not None and result == "failed" and known.match in detail:
        result, detail = known.kind, f"{known.reason} (`{detail}`)"
    return Result(ex.path, ex.launch.value, list(ex.args), result, detail, round(seconds, 1))


def write_section(page: Path, results: list[Result], meta: dict[str, str]) -> None:
    """Replace the examples section of ``page`` (or append it) with ``results``."""
    counts = {k: sum(r.result == k for r in results) for k in _ORDER}
    summary = ", ".join(f"{n} {k}" for k, n in counts.items() if n)
    lines = [BEGIN, "", *_INTRO, "", f"Horovod source: commit `{meta['horovod_commit']}`. "]
    lines[-1] += (
        f"ringtrain: commit `{meta['ringtrain_commit']}`"
        + (" with uncommitted changes" if meta.get("uncommitted") else "")
        + f". Run {meta['date']}, "
        f"{len(results)} examples: {summary}."
    )
    lines += ["", "| example | launch | flags | stand-ins | result | seconds |"]
    lines += ["|---|---|---|---|---|---:|"]
    standins = {e.path: e.standins for e in EXAMPLES}
    for r in results:
        flags = " ".join(r.args)
        cell = r.result if not r.detail else f"{r.result}: {r.detail}"
        row = [f"`{r.example}`", r.launch, f"`{flags}`" if flags else "—"]
        row += [standins.get(r.example) or "—", cell.replace("|", "\\|"), f"{r.seconds:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    section = "\n".join([*lines, "", END])
    text = page.read_text() if page.exists() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + section + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    page.write_text(text)


_ORDER = ("passed", "failed", "hang", "not ours", "not runnable here")
_INTRO = [
    "## Horovod's examples",
    "",
    "Every example under `examples/tensorflow2`, `examples/keras`, `examples/pytorch`,",
    "`examples/elastic` and `examples/ray` of Horovod's source, run unchanged through the",
    "`horovod` shim (`python tools/examples.py --horovod-src <Horovod checkout or git dir>`;",
    "this section is written by it). Launches: *horovodrun* is 2 ranks with the variables",
    "`horovodrun -np 2 --gloo` sets; *ringrun* (the elastic examples) is ringtrain's own",
    "launcher in elastic mode, `python -m ringrun --min-np 1 --max-np 2",
    "--host-discovery-script S` with `S` printing `localhost:2`; *ray* runs the example as",
    "the driver of a local Ray with `num_cpus=2`. The shim adds to the suites' modules",
    "`horovod.ray` (ray_runner's",
    "`RayExecutor`, `ElasticRayExecutor`, `ray_logger`), `horovod.torch.elastic.sampler` and",
    "`hvd.elastic` on `import horovod.torch` (as Horovod's package does; `import",
    "ringcore.torch` alone does not import `ringcore.torch.elastic`). No internet: the MNIST",
    "stand-in is a generated file with MNIST's arrays (512 training and 256 test images",
    "28x28, uint8), read by `keras.datasets.mnist.load_data` (its download pointed at the",
    "file) and by a stand-in `torchvision` (`datasets.MNIST`, `transforms`, and",
    "`models.resnet50`: a small net with ResNet-50's call shape); both are in",
    "`tools/example_standins`. Flags are the example's own, chosen to cap its work",
    "(`{data}`: the stand-in's folder, `{address}`: the local Ray's address). *Not ours* is",
    "a failure in the example's own code on today's frameworks (written for Keras 2,",
    "TensorFlow 1, an older Lightning or an older `horovod.ray`); *not runnable here* needs",
    "what this machine or ringtrain lacks (GPUs, the `tensorboard` package, Horovod's tf.data",
    "service). Each gives its reason, then the line the example failed on.",
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--horovod-src", type=Path)
    parser.add_argument(
        "--report", type=Path, help="write --out's examples section from this JSON and stop"
    )
    parser.add_argument("--only", action="append", help="run examples whose path contains this")
    parser.add_argument("--timeout", type=float, default=420.0, help="seconds per example")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "conformance.md")
    parser.add_argument("--json", type=Path, default=ROOT / "build" / "examples.json")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args(argv)
    if args.report:
        data = json.loads(args.report.read_text())
        write_section(args.out, [Result(**r) for r in data["examples"]], data["meta"])
        print(f"wrote {args.out}")
        return 0
    if args.horovod_src is None:
        parser.error("--horovod-src is required (a Horovod checkout or its git directory)")
    chosen = [e for e in EXAMPLES if not args.only or any(o in e.path for o in args.only)]
    work = Path(tempfile.mkdtemp(prefix="ringtrain-examples-"))
    results: list[Result] = []
    try:
        materialize(args.horovod_src, work)
        for i, ex in enumerate(chosen, 1):
            res = run_example(work, ex, args.timeout)
            results.append(res)
            note = f" - {res.detail}" if res.detail else ""
            print(
                f"[{i}/{len(chosen)}] {res.result} {res.seconds:5.1f}s {ex.path}{note}", flush=True
            )
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    meta = _meta(args.horovod_src)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"meta": meta, "examples": [asdict(r) for r in results]}))
    if not args.only:
        write_section(args.out, results, meta)
        print(f"wrote {args.out}")
    bad = [r for r in results if r.result in ("failed", "hang")]
    print(f"{sum(r.result == 'passed' for r in results)} passed, {len(bad)} failed or hung")
    return 1 if bad else 0


def _meta(src: Path) -> dict[str, str]:
    git = ["git", "-C", str(ROOT)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(
        [*git, "status", "--porcelain", "--untracked-files=no"], text=True, capture_output=True
    ).stdout.strip()
    return {
        "horovod_commit": horovod_commit(src),
        "ringtrain_commit": commit.stdout.strip(),
        "uncommitted": "yes" if dirty else "",
        "date": time.strftime("%Y-%m-%d"),
    }


if __name__ == "__main__":
    sys.exit(main())
