"""Load: consecutive tiny fits in one SparkSession leak nothing, on either side: 10 in
`make test`, 20 in `make reliability` (``RELIABILITY_FITS``).

Counted with psutil after every fit and bounded between the warm-up and the late fits:

- the driver: threads, child processes, listening sockets, connections, open files;
- the Spark Python workers that ran the ranks (``local[2]``: the JVM, a child of this
  process, runs ``pyspark.daemon``, which forks the workers and keeps them for reuse
  from fit to fit): how many there are, their threads, open files, sockets;
- processes a fit left behind: any new descendant of the driver other than the daemon
  and its workers, and any process anywhere carrying this test's marker variable (which
  every Spark Python process inherits), so a rank's orphan counts too: none, ever;
- ``/dev/shm/ringshm-*`` segments (``ringcore.shm.segment``): none created, none
  mapped by the driver or a worker; no ``ringtrain*`` file or folder in the temporary
  directory (``TMPDIR``, set for the workers and the driver alike to one of this test's
  own), and nothing new there after the warm-up (torch makes its cache folder once).
"""

from __future__ import annotations

import os
import tempfile
import time
import uuid

import numpy as np
import psutil
import pytest
import torch
from _reliability import record

import spark_runner
from estimators import RingEstimator, Store

FITS = int(os.environ.get("RELIABILITY_FITS", "10"))
WARM_UP = 3
SHM_DIR = "/dev/shm"
SHM_PREFIX = "ring"  # ringcore.shm.segment names its segments ringshm-<prefix>-<token>
MARK_VAR = "RINGTRAIN_FIT_LEAKS_MARK"
MARK = uuid.uuid4().hex


@pytest.fixture(scope="module")
def private_tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("fit_leaks_tmpdir")


@pytest.fixture(scope="module")
def spark(private_tmp):
    session = spark_runner.local_session(
        "local[2]",
        app_name="test_fit_leaks",
        conf={
            "spark.sql.shuffle.partitions": "2",
            # pyspark.daemon is started with these, and every worker it forks inherits
            # them: the marker finds a worker's orphans, TMPDIR its temporary files
            f"spark.executorEnv.{MARK_VAR}": MARK,
            "spark.executorEnv.TMPDIR": str(private_tmp),
        },
    )
    session.sparkContext.setLogLevel("ERROR")
    try:
        yield session
    finally:
        session.stop()


# -- what a process holds, and who is who ----------------------------------------------


def _holds(p: psutil.Process) -> dict[str, int]:
    conns = p.net_connections("inet")
    return {
        "threads": p.num_threads(),
        "fds": p.num_fds(),
        "listening": sum(1 for c in conns if c.status == psutil.CONN_LISTEN),
        "connections": len(conns),
    }


def _cmdline(p: psutil.Process | int) -> str:
    try:
        return " ".join((psutil.Process(p) if isinstance(p, int) else p).cmdline())
    except psutil.Error:
        return "?"


def _spark_python(descendants: list[psutil.Process]) -> tuple[list, list]:
    """pyspark.daemon (forked by the JVM) and the Python workers it forked."""
    daemons = []
    for p in descendants:
        try:
            if "pyspark.daemon" in p.cmdline() and "pyspark.daemon" not in p.parent().cmdline():
                daemons.append(p)
        except psutil.Error:
            continue
    workers = [w for d in daemons for w in _alive_children(d)]
    return daemons, workers


def _alive_children(p: psutil.Process) -> list[psutil.Process]:
    try:
        return p.children()
    except psutil.Error:
        return []


def _marked() -> set[int]:
    """Every process, wherever it is in the tree, that carries this test's marker."""
    found = set()
    for p in psutil.process_iter():
        try:
            if p.environ().get(MARK_VAR) == MARK:
                found.add(p.pid)
        except psutil.Error:  # another user's, or gone
            continue
    return found


def _shm_segments() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if n.startswith(SHM_PREFIX)}


def _shm_mapped(procs: list[psutil.Process]) -> list[str]:
    """ringcore segments still mapped by one of ``procs`` (an unlinked one reads
    ``/dev/shm/ringshm-... (deleted)``)."""
    mapped = []
    for p in procs:
        try:
            with open(f"/proc/{p.pid}/maps") as fh:
                mapped += [
                    f"{p.pid}: {line.split(None, 5)[-1].strip()}"
                    for line in fh
                    if f"{SHM_DIR}/{SHM_PREFIX}" in line
                ]
        except OSError:
            continue
    return mapped


class Census:
    """What the driver and its Spark Python processes hold after a fit, and what a fit
    must never leave (``leftovers``)."""

    def __init__(self, private_tmp):
        self.me = psutil.Process()
        self.tmp = private_tmp
        self.before = {p.pid for p in self.me.children(recursive=True)}  # the JVM, ...
        self.shm_before = _shm_segments()
        #: what the warm-up left in TMPDIR (torch's own cache folder, created once);
        #: None until the warm-up is over
        self.tmp_known: set[str] | None = None

    def take(self) -> tuple[dict[str, int], list[str]]:
        descendants = self.me.children(recursive=True)
        daemons, workers = _spark_python(descendants)
        spark_python = {p.pid for p in daemons + workers}
        counts = {f"driver {k}": v for k, v in _holds(self.me).items()}
        counts["driver descendants"] = len(descendants)
        counts["workers"] = len(workers)
        per_worker = []
        for w in workers:
            try:
                per_worker.append(_holds(w))
            except psutil.Error:  # Spark ended an idle worker just now
                continue
        for k in ("threads", "fds"):  # the most a reused worker holds
            counts[f"worker {k}"] = max((h[k] for h in per_worker), default=0)
        for k in ("listening", "connections"):  # a store server or a socket left open
            counts[f"worker {k}"] = sum(h[k] for h in per_worker)
        leftovers = [
            f"descendant {p.pid} {_cmdline(p)}"
            for p in descendants
            if p.pid not in self.before and p.pid not in spark_python
        ]
        leftovers += [
            f"marked process {pid} {_cmdline(pid)}" for pid in sorted(_marked() - spark_python)
        ]
        new_shm = _shm_segments() - self.shm_before
        if new_shm:  # another user's job on this machine may hold one for an instant
            time.sleep(2.0)
            new_shm &= _shm_segments()
        leftovers += [f"{SHM_DIR}/{n}" for n in sorted(new_shm)]
        leftovers += [f"mapped {m}" for m in _shm_mapped([self.me, *workers])]
        temporary = set(os.listdir(self.tmp))
        leftovers += [f"temporary {n}" for n in sorted(temporary) if n.startswith("ringtrain")]
        if self.tmp_known is not None:
            leftovers += [f"temporary {n} (new)" for n in sorted(temporary - self.tmp_known)]
        return counts, leftovers

    def warmed_up(self) -> None:
        self.tmp_known = set(os.listdir(self.tmp))


# What a fit may leave between fits without leaking, the growth from the warm-up to the
# late fits: a few pooled threads, sockets in their keep-alive and files (jars, Spark's
# block manager) on the driver; on the Spark side one more Python worker than at the
# warm-up (Spark forks one when a task starts before the last one's worker is back in
# the pool, and ends idle ones after a minute), and per worker a few threads and files
# that torch and Arrow open once, lazily. A leak of one thread, file or socket per fit
# grows by at least 10 over the late fits.
SLACK = {
    "driver threads": 4,
    "driver descendants": 2,
    "driver listening": 1,
    "driver connections": 4,
    "driver fds": 12,
    "workers": 1,
    "worker threads": 4,
    "worker fds": 8,
    "worker listening": 1,
    "worker connections": 4,
}


@pytest.mark.spark
@pytest.mark.slow
@pytest.mark.reliability(
    fault="consecutive fits in one SparkSession (10; 20 at full size)", category="load"
)
@pytest.mark.timeout(480)
def test_consecutive_fits_in_one_session_leak_no_threads_processes_ports_or_files(
    spark, private_tmp, tmp_path, request, monkeypatch
):
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))  # the driver's, as TMPDIR
    rng = np.random.default_rng(0)
    rows = [(rng.normal(size=4).tolist(), int(rng.integers(0, 2))) for _ in range(32)]
    df = spark.createDataFrame(rows, ["x", "y"])
    census = Census(private_tmp)
    seen = []
    for i in range(FITS):
        torch.manual_seed(i)
        model = torch.nn.Linear(4, 2)
        fitted = RingEstimator(
            model=model,
            optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
            loss=torch.nn.CrossEntropyLoss(),
            feature_cols=["x"],
            label_cols=["y"],
            batch_size=8,
            epochs=1,
            num_proc=2,
            reader="arrow",
            verbose=0,
            random_seed=i,
            store=Store.create(str(tmp_path / f"store{i % 2}")),  # alternate: write, reuse
            run_id=f"fit{i}",
        ).fit(df)
        assert [e["epoch"] for e in fitted.getHistory()] == [1]
        counts, leftovers = census.take()
        assert not leftovers, f"fit {i} left {leftovers}"
        assert counts["workers"] >= 1, f"fit {i}: no Spark Python worker found: {counts}"
        seen.append(counts)
        if i == WARM_UP - 1:
            census.warmed_up()
    warm = {k: max(c[k] for c in seen[WARM_UP - 1 : WARM_UP + 2]) for k in SLACK}
    late = {k: max(c[k] for c in seen[FITS // 2 :]) for k in SLACK}
    grown = {k: late[k] - warm[k] for k in SLACK}
    over = {k: v for k, v in grown.items() if v > SLACK[k]}
    assert not over, (over, seen)
    record(request, cases=FITS, note=", ".join(f"{k} +{v}" for k, v in grown.items()))
