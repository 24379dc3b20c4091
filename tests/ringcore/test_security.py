"""The engine's control connection lets in only ranks that know the job's secret.

A rogue client (this test process, which does not know the secret) connects to rank 0's
coordinator while the job starts: it is refused and closed, the requests it sent are
never executed, and the job goes on with correct results. A rank with a wrong secret
cannot join either. The secret never shows in output, log records, exceptions, reprs
or the store — under ``run_workers``, a ``spark_runner.run`` job (its log server's
secret too: the task output, the driver's logs, Spark's task failure text) and a Ray
job (``RayExecutor`` and ``RingTrainer``: actor output, a failed rank's exception, the
run folder, Ray's log files).
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import re
import socket
import struct
import sys
import threading
import time
import traceback
import zlib
from pathlib import Path

import _spark
import pytest
from _reliability import record

from ringcore import RendezvousError, WorkerError
from ringcore.testing import run_workers

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

_HEADER = struct.Struct("!I")


# -- the workers ------------------------------------------------------------------------


def _hold_rank_1_until(go: Path, addr_file: Path) -> list[str]:
    """Seam: rank 0 publishes the coordinator's address, rank 1 connects only once the
    test says go (so the rogue client is at the port before the job is complete).
    Returns the list the name of every op run is recorded into (a response's, or a batch
    the fast lane ran)."""
    from ringcore.engine import engine as eng

    executed: list[str] = []
    orig_init, orig_execute = eng.Engine.__init__, eng.Engine._execute
    orig_lane = eng.Engine._run_batch

    def init(self, backend, rank, size, addr, *args, **kwargs):
        if rank == 0:  # whole or not at all: the attacker reads it once it exists
            part = addr_file.with_name(addr_file.name + ".part")
            part.write_text(json.dumps(list(addr)))
            os.replace(part, addr_file)
        else:
            deadline = time.monotonic() + 60
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        orig_init(self, backend, rank, size, addr, *args, **kwargs)

    def execute(self, item):
        executed.extend(e.name or "?" for e in item.entries)
        return orig_execute(self, item)

    def run_batch(self, batch):  # the fast lane's ops: run without a response
        executed.extend(h.name for _, h in batch)
        return orig_lane(self, batch)

    eng.Engine.__init__ = init  # type: ignore[method-assign]
    eng.Engine._execute = execute  # type: ignore[method-assign]
    eng.Engine._run_batch = run_batch  # type: ignore[method-assign]
    return executed


def _rogue_target_worker(tmp: str):
    import torch

    import ringcore.torch as hvd
    from ringcore.runtime import state as rt

    executed = _hold_rank_1_until(Path(tmp, "go"), Path(tmp, "addr"))
    hvd.init()
    r, n = hvd.rank(), hvd.size()
    out: dict = {"rank": r}
    # the job runs on, and its results are right
    out["sum"] = hvd.allreduce(torch.full((4,), float(r + 1)), op=hvd.Sum, name="real").tolist()
    out["gather"] = hvd.allgather(torch.tensor([r]), name="g").tolist()
    out["bcast"] = hvd.broadcast(torch.tensor([r * 10 + 7]), root_rank=1, name="b").tolist()
    if r == 0:  # every rank is in by now (the allreduce needed rank 1)
        host, port = json.loads(Path(tmp, "addr").read_text())
        try:  # and then the port is closed: nobody can even connect
            socket.create_connection((host, port), timeout=2).close()
            out["late_connect"] = "accepted"
        except OSError as exc:
            out["late_connect"] = type(exc).__name__
        out["refused"] = rt.current.coordinator.refused
    out["size"] = n
    out["executed"] = executed
    return out


def _frame(obj) -> bytes:
    data = json.dumps(obj).encode()
    return _HEADER.pack(len(data)) + data


def _read_frame(sock: socket.socket):
    buf = b""
    while len(buf) < 4:
        chunk = sock.recv(4 - len(buf))
        if not chunk:
            return None
        buf += chunk
    (n,) = _HEADER.unpack(buf)
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return json.loads(data)


def _closed_within(sock: socket.socket, timeout_s: float) -> float | None:
    """Seconds until the peer closed the connection (None: still open after timeout_s)."""
    t0 = time.monotonic()
    sock.settimeout(0.2)
    while time.monotonic() - t0 < timeout_s:
        try:
            if sock.recv(65536) == b"":
                return time.monotonic() - t0
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t0
    return None


_ROGUE_REQ = {
    "t": "req",
    "reqs": [
        {"n": "rogue.tensor", "k": "allreduce", "d": "float32", "s": [1], "o": 1, "ps": 0},
        {"n": "real", "k": "allreduce", "d": "float64", "s": [4], "o": 1, "ps": 0},
    ],
}


def _attack(addr_file: Path, go: Path, report: dict) -> None:
    """What a stranger on the network can try, without the secret."""
    try:
        deadline = time.monotonic() + 60
        while not addr_file.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        host, port = json.loads(addr_file.read_text())
        silent = socket.create_connection((host, port), timeout=5)  # says nothing at all
        # 1. a forged hello claiming rank 1, with a request piggy-backed on it
        t0 = time.monotonic()
        forged = socket.create_connection((host, port), timeout=5)
        report["challenge"] = _read_frame(forged)
        nonce = report["challenge"]["nonce"]
        forged.sendall(
            _frame({"t": "hello", "rank": 1, "nonce": nonce, "mac": "00" * 32}) + _frame(_ROGUE_REQ)
        )
        report["forged_reply"] = _read_frame(forged)
        report["forged_closed_s"] = _closed_within(forged, 10)
        report["forged_detect_s"] = time.monotonic() - t0
        # 2. the old protocol: a bare hello and a request, without reading the challenge
        bare = socket.create_connection((host, port), timeout=5)
        bare.sendall(_frame({"t": "hello", "rank": 1}) + _frame(_ROGUE_REQ))
        report["bare_closed_s"] = _closed_within(bare, 10)
        # 3. not even JSON, and a frame claiming 2 GB
        junk = socket.create_connection((host, port), timeout=5)
        junk.sendall(_HEADER.pack(1 << 31) + b"\x80\x04garbage")
        report["junk_closed_s"] = _closed_within(junk, 10)
        go.touch()  # now the real rank 1 may join
        report["silent_closed_s"] = _closed_within(silent, 20)
        for s in (silent, forged, bare, junk):
            s.close()
    except Exception as exc:
        report["error"] = repr(exc)
        go.touch()


@pytest.mark.reliability(
    fault="a rogue client without the secret at the coordinator's port", category="security"
)
@pytest.mark.timeout(120)
def test_a_rogue_client_is_refused_and_nothing_it_sent_is_executed(tmp_path, request):
    report: dict = {}
    attacker = threading.Thread(
        target=_attack, args=(tmp_path / "addr", tmp_path / "go", report), daemon=True
    )
    attacker.start()
    res = run_workers(_rogue_target_worker, np=2, args=(str(tmp_path),), timeout=90)
    attacker.join(30)
    assert "error" not in report, report
    assert report["challenge"]["t"] == "challenge"
    assert report["forged_reply"] == {"t": "denied"}
    for kind in ("forged", "bare", "junk", "silent"):
        assert report[f"{kind}_closed_s"] is not None, f"the {kind} rogue was never closed"
    # the job went on, correct, and none of the rogue's requests ran anywhere
    for out in res:
        assert out["sum"] == [3.0] * 4
        assert out["gather"] == [0, 1]
        assert out["bcast"] == [17]
        assert "rogue.tensor" not in out["executed"]
        assert out["executed"].count("real") == 1, out["executed"]
    assert res[0]["refused"] >= 3  # forged, bare, junk (the silent one times out later)
    assert res[0]["late_connect"] == "ConnectionRefusedError"
    record(request, detect_s=report["forged_detect_s"], cases=4)


def _wrong_secret_worker():
    import torch

    import ringcore.torch as hvd

    if int(os.environ["RING_RANK"]) == 1:
        os.environ["RING_SECRET_KEY"] = "not-the-job-secret"
    t0 = time.monotonic()
    try:
        hvd.init()
        hvd.allreduce(torch.ones(1), name="x")
        return "joined"
    except Exception as exc:
        return (type(exc).__name__, str(exc), time.monotonic() - t0)


@pytest.mark.reliability(fault="a rank with the wrong secret", category="security")
@pytest.mark.timeout(90)
def test_a_rank_with_the_wrong_secret_cannot_join_and_the_others_fail_cleanly(request):
    res = run_workers(_wrong_secret_worker, np=2, env={"RING_START_TIMEOUT": "6"}, timeout=60)
    kind1, msg1, t1 = res[1]
    assert kind1 == RendezvousError.__name__
    assert "refused rank 1" in msg1 and "RING_SECRET_KEY" in msg1
    kind0, msg0, t0 = res[0]
    assert kind0 == "RingInternalError" and "ranks [1]" in msg0 and "did not connect" in msg0
    assert "not-the-job-secret" not in msg0 + msg1
    # rank 1 learns at once; the others wait out RING_START_TIMEOUT, since a refused
    # handshake may be a stranger's and must not end the job
    record(request, detect_s=t1, note=f"the other ranks fail after RING_START_TIMEOUT: {t0:.1f} s")


# -- the secret never leaks -------------------------------------------------------------


def _leak_worker(secret: str, store_port: int):
    """Every text a job's secret could reach inside a rank: reprs, error messages, log
    records, what the rank prints and logs (to its stdout and stderr, which the launcher
    carries), the store. Leaves the process as it was (Spark and Ray reuse it)."""
    import datetime

    import torch
    import torch.distributed as dist

    import ringcore.torch as hvd
    from ringcore.runtime import state as rt

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, rec):
            records.append(rec)

    logger = logging.getLogger("ringtrain")
    level, handlers = logger.level, [Keep(), logging.StreamHandler()]  # and to stderr
    logger.setLevel(logging.DEBUG)
    for handler in handlers:
        logger.addHandler(handler)
    texts: list[str] = []
    secrets_seen = [secret]
    try:
        for fallback in (False, True):
            if fallback:  # no secret from the launcher: rank 0 makes one
                del os.environ["RING_SECRET_KEY"]
            hvd.init()
            r = hvd.rank()
            if fallback and r == 0:
                secrets_seen.append(rt.current.coordinator._secret)
            texts += [
                repr(rt.current),
                repr(rt.current.engine.channel),
                repr(rt.current.coordinator),
            ]
            x = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="ok")
            assert x.tolist() == [2.0, 2.0]
            try:  # an error message that goes through every layer
                hvd.allreduce(torch.ones(2 + r), name="mismatch")
            except Exception as exc:
                texts += [str(exc), repr(exc)]
            keys = sorted(k for k in os.environ if "RING" in k)
            print(f"rank {r} environment keys: {keys}", flush=True)
            hvd.shutdown()
        store = dist.TCPStore(
            "127.0.0.1", store_port, 2, False, timeout=datetime.timedelta(seconds=30)
        )
        values = [k for k in store.list_keys()]
        values += [store.get(k).decode(errors="replace") for k in values]
        # a launcher whose rank 0 hosts the store (Spark) must not drop it under rank 1
        store.add("leaktest/listed", 1)
        deadline = time.monotonic() + 30
        while int(store.add("leaktest/listed", 0)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        # and rank 0 (the host) leaves last: rank 1's final call must not find it gone
        if r == 0:
            while int(store.add("leaktest/left", 0)) < 1 and time.monotonic() < deadline:
                time.sleep(0.05)
        else:
            store.add("leaktest/left", 1)
    finally:
        os.environ["RING_SECRET_KEY"] = secret
        logger.setLevel(level)
        for handler in handlers:
            logger.removeHandler(handler)
    texts += [rec.getMessage() for rec in records] + [str(rec.args) for rec in records]
    return {"texts": texts, "store": values, "secrets": secrets_seen}


@pytest.mark.reliability(
    fault="the secret in output, logs, exceptions, reprs or the store", category="security"
)
@pytest.mark.timeout(90)
def test_the_secret_never_appears_in_output_logs_exceptions_reprs_or_the_store(capfd, request):
    secret = "s3cr3t-" + os.urandom(16).hex()
    # the store is the one run_workers hosts; the workers read its port from their env
    res = run_workers(_leak_by_env, np=2, env={"RING_SECRET_KEY": secret}, timeout=60)
    out, err = capfd.readouterr()
    assert "environment keys" in out and "RING_SECRET_KEY" in out  # the name, not the value
    checked = 0
    for rank_result in res:
        assert len(rank_result["texts"]) >= 6 and rank_result["store"]
        for s in rank_result["secrets"]:
            for text in [out, err, *rank_result["texts"], *rank_result["store"]]:
                assert s not in text
                checked += 1
    assert len(res[0]["secrets"]) == 2  # the launcher's and the fallback's
    record(request, cases=2, note=f"{checked} texts searched for 2 secrets")


def _leak_by_env():
    return _leak_worker(os.environ["RING_SECRET_KEY"], int(os.environ["RING_STORE_PORT"]))


# -- the same search in a Spark job and in a Ray job ---------------------------------------

_SHARD_ERROR = "rank 1 cannot read its shard"
# how a Spark task with no log-server connection carries a worker's error in its failure
# text: a zlib'd pickle, base64
_ERROR_BLOB = re.compile(r"<<ringtrain-worker-error:(?:[0-9a-f]{64}:)?([A-Za-z0-9+/=]+):")


def _launcher_secrets() -> list[str]:
    """The secrets the launcher gave this rank: the ring's (``RING_SECRET_KEY``) and, in
    a Spark task, its log server's, which only the task's ``TaskSpec`` holds."""
    import gc

    ring = os.environ["RING_SECRET_KEY"]
    # init() froze the heap for the collector (ringcore.runtime.heap), and gc.get_objects() lists
    # only what is not frozen: the task's spec, made before init(), is frozen
    frozen = gc.get_freeze_count()
    gc.unfreeze()
    try:
        specs = [
            o
            for o in gc.get_objects()
            if type(o).__name__ == "TaskSpec" and getattr(o, "ring_secret", None) == ring
        ]
    finally:
        if frozen:
            gc.freeze()
    return [ring] + [spec.secret for spec in specs[:1]]


def _spark_leak_worker():
    res = _leak_by_env()
    res["secrets"] += _launcher_secrets()[1:]  # the log server's
    return res


def _raising_worker(secrets_dir: str):
    import ringcore.torch as hvd

    hvd.init()
    Path(secrets_dir, f"{os.getpid()}-{hvd.rank()}").write_text("\n".join(_launcher_secrets()))
    print(f"rank {hvd.rank()} starts", flush=True)
    hvd.barrier()
    if hvd.rank() == 1:
        raise ValueError(_SHARD_ERROR)
    return "done"


def _raising_loop(config):
    import tempfile

    import ray_runner
    import ringcore.torch as hvd

    hvd.init()
    Path(config["secrets"], f"trainer-{hvd.rank()}").write_text(os.environ["RING_SECRET_KEY"])
    print(f"rank {hvd.rank()} trains on its shard", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "state.json").write_text(json.dumps({"epoch": 0}))
        checkpoint = ray_runner.Checkpoint.from_directory(tmp)
        ray_runner.report({"epoch": 0, "loss": 1.0}, checkpoint=checkpoint)
    hvd.barrier()  # rank 0's checkpoint is in the run folder before rank 1 fails
    if hvd.rank() == 1:
        raise ValueError(_SHARD_ERROR)


def _exception_texts(exc: BaseException | None, seen: set | None = None) -> list[str]:
    """An exception as anyone may see it: str, repr, its traceback, its fields (a
    WorkerError's traceback, a TrainingFailedError's worker errors), and the same of its
    cause and context — for a Spark job, the Py4J error holding Spark's failure text
    (and a worker error pickled in it, by a task with no log-server connection, unpacked
    here too)."""
    seen = set() if seen is None else seen
    if exc is None or id(exc) in seen:
        return []
    seen.add(id(exc))
    texts = [str(exc), repr(exc), "".join(traceback.format_exception(exc))]
    for value in vars(exc).values():
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, BaseException):
                texts += _exception_texts(item, seen)
            else:
                texts.append(str(item))
    for blob in _ERROR_BLOB.findall("\n".join(texts)):
        texts.append(zlib.decompress(base64.b64decode(blob)).decode("latin-1"))
    return texts + _exception_texts(exc.__cause__, seen) + _exception_texts(exc.__context__, seen)


def _file_texts(root: str | Path) -> list[tuple[str, str]]:
    texts = []
    for folder, _, names in os.walk(root):
        for name in names:
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as fh:
                    texts.append((path, fh.read().decode("latin-1")))
            except OSError:
                continue
    return texts


def _log_texts(records: list[logging.LogRecord]) -> list[tuple[str, str]]:
    return [
        (f"log record {r.name}", f"{r.getMessage()} {r.args} {r.exc_text or ''}") for r in records
    ]


def _secrets_from(folder: Path) -> list[str]:
    return sorted({s for f in folder.iterdir() for s in f.read_text().split()})


def _assert_nowhere(secrets: list[str], texts: list[tuple[str, str]]) -> int:
    """No secret in any text. Names where one was found, never the secret itself."""
    assert secrets and all(len(s) >= 16 for s in secrets)
    found = sorted({where for where, text in texts for s in secrets if s in text})
    assert not found, f"a job secret appears in: {found}"
    return len(texts) * len(secrets)


@pytest.mark.spark
@pytest.mark.reliability(
    fault="the secrets of a Spark job in its output, logs, task failures or store",
    category="security",
)
@pytest.mark.timeout(300)
def test_the_secrets_of_a_spark_job_never_appear_in_output_logs_task_failures_or_the_store(
    capfd, caplog, tmp_path, request
):
    import spark_runner

    caplog.set_level(logging.DEBUG, logger="ringtrain")
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    out, err = io.StringIO(), io.StringIO()  # the task output, through the log server
    _spark.shared_session()  # not stopped here: see tests/_spark.py
    res = spark_runner.run(_spark_leak_worker, num_proc=2, stdout=out, stderr=err, verbose=2)
    with pytest.raises(WorkerError) as failed:
        spark_runner.run(
            _raising_worker,
            args=(str(secrets_dir),),
            num_proc=2,
            stdout=out,
            stderr=err,
            verbose=2,
        )
    failure = _exception_texts(failed.value)  # Spark's text: while the JVM is up
    captured = capfd.readouterr()
    # what was searched holds what it should: the texts are the real ones
    assert "environment keys" in out.getvalue() and "RING_SECRET_KEY" in out.getvalue()
    assert "joined through ringtrain" in err.getvalue()  # the ranks' log records
    assert failed.value.rank == 1 and _SHARD_ERROR in str(failed.value)
    spark_text = [t for t in failure if "Py4JJavaError" in t]  # Spark's text for the task
    assert spark_text and any(_SHARD_ERROR in t for t in spark_text)
    assert not any(_ERROR_BLOB.search(t) for t in failure)  # the blob went by the log server
    assert any(r.name == "ringtrain.spark_runner" for r in caplog.records)
    assert [len(r["secrets"]) for r in res] == [3, 2]  # ring, fallback (rank 0), log server
    failed_job = _secrets_from(secrets_dir)
    assert len(failed_job) == 2  # that job's ring and log server secrets
    secrets = sorted({s for r in res for s in r["secrets"]} | set(failed_job))
    texts = [
        ("task stdout", out.getvalue()),
        ("task stderr", err.getvalue()),
        ("driver stdout", captured.out),
        ("driver stderr", captured.err),
        *_log_texts(caplog.records),
        *[("the failed job's exception", t) for t in failure],
    ]
    for r in res:
        texts += [("a rank's text", t) for t in r["texts"]]
        texts += [("the store", t) for t in r["store"]]
    checked = _assert_nowhere(secrets, texts)
    record(request, cases=2, note=f"{checked} texts searched for {len(secrets)} secrets")


@pytest.mark.ray
@pytest.mark.reliability(
    fault="the secrets of a Ray job in actor output, failures, the run folder or the store",
    category="security",
)
@pytest.mark.timeout(300)
def test_the_secrets_of_a_ray_job_never_appear_in_actor_output_failures_or_the_run_folder(
    capfd, caplog, tmp_path, request
):
    ray = pytest.importorskip("ray")
    import ray_runner

    caplog.set_level(logging.DEBUG, logger="ringtrain")
    secrets_dir = tmp_path / "secrets"
    secrets_dir.mkdir()
    owns = not ray.is_initialized()
    if owns:
        ray.init(address="local", num_cpus=2, _node_ip_address="127.0.0.1", include_dashboard=False)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # actors cannot import it
    try:
        logs_dir = ray._private.worker._global_node.get_logs_dir_path()
        with ray_runner.RayExecutor(num_workers=2) as executor:
            res = executor.run(_leak_by_env)
            with pytest.raises(WorkerError) as failed_run:
                executor.run(_raising_worker, args=(str(secrets_dir),))
        trainer = ray_runner.RingTrainer(
            _raising_loop,
            train_loop_config={"secrets": str(secrets_dir)},
            scaling_config=ray_runner.ScalingConfig(num_workers=2),
            run_config=ray_runner.RunConfig(
                name="leak",
                storage_path=str(tmp_path / "runs"),
                failure_config=ray_runner.FailureConfig(max_failures=0),
            ),
        )
        with pytest.raises(ray_runner.TrainingFailedError) as failed_fit:
            trainer.fit()
        # the actors' output reaches the driver and Ray's log files a little later
        output, deadline = "", time.monotonic() + 120
        while time.monotonic() < deadline:
            output += capfd.readouterr().out
            logs = _file_texts(logs_dir)
            actor_logs = "".join(t for _, t in logs)
            if all(
                "environment keys" in text and "trains on its shard" in text
                for text in (output, actor_logs)
            ):
                break
            time.sleep(1.0)
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        if owns:
            ray.shutdown()
    captured = capfd.readouterr()
    output += captured.out
    for text in (output, actor_logs):  # the actors' output, forwarded and in Ray's files
        assert "environment keys" in text and "trains on its shard" in text
    assert failed_run.value.rank == 1 and _SHARD_ERROR in str(failed_run.value)
    assert failed_fit.value.worker_error.rank == 1 and _SHARD_ERROR in str(failed_fit.value)
    run_folder = _file_texts(tmp_path / "runs")
    assert any("state.json" in path for path, _ in run_folder)  # rank 0's checkpoint
    secrets = sorted({s for r in res for s in r["secrets"]} | set(_secrets_from(secrets_dir)))
    assert len(secrets) == 3  # the executor's (both runs), the fallback, the trainer's
    texts = [
        ("driver stdout", output),
        ("driver stderr", captured.err),
        *_log_texts(caplog.records),
        *[("the failed run's exception", t) for t in _exception_texts(failed_run.value)],
        *[("the failed fit's exception", t) for t in _exception_texts(failed_fit.value)],
        *run_folder,
        *logs,
    ]
    for r in res:
        texts += [("a rank's text", t) for t in r["texts"]]
        texts += [("the store", t) for t in r["store"]]
    checked = _assert_nowhere(secrets, texts)
    record(request, cases=2, note=f"{checked} texts searched for {len(secrets)} secrets")


# -- the handshake and the per-message HMAC, in one process ---------------------------------


def _pair(server_secret: str, client_secret: str):
    from ringcore.engine.wire import accept_handshake, connect_handshake

    listener = socket.create_server(("127.0.0.1", 0))
    got: dict = {}

    def serve():
        sock, _ = listener.accept()
        try:
            got["rank"], got["ch"] = accept_handshake(sock, server_secret, timeout_s=5)
        except Exception as exc:
            got["error"] = exc

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    sock = socket.create_connection(listener.getsockname(), timeout=5)
    try:
        client = connect_handshake(sock, client_secret, 3, timeout_s=5)
    except Exception as exc:
        client = exc
    t.join(5)
    listener.close()
    return got, client


@pytest.mark.reliability(
    fault="a forged, replayed or tampered control message", category="security", cases=2
)
@pytest.mark.timeout(30)
def test_signed_frames_pass_and_tampered_or_replayed_frames_close_the_connection():
    from ringcore._auth import AuthenticationError

    got, client = _pair("k" * 64, "k" * 64)
    server = got["ch"]
    assert got["rank"] == 3 and "k" * 8 not in repr(server) + repr(client)
    client.send({"t": "req", "reqs": [1]})
    client.send({"t": "req", "reqs": [2]})
    assert server.recv() == {"t": "req", "reqs": [1]}
    assert server.recv() == {"t": "req", "reqs": [2]}
    server.send({"t": "resp"})
    assert client.recv() == {"t": "resp"}
    # a replay of a frame that passed: its sequence number is stale
    frame = _frame_signed(client, {"t": "req", "reqs": [3]})
    client.sock.sendall(frame)
    assert server.recv() == {"t": "req", "reqs": [3]}
    client.sock.sendall(frame)
    with pytest.raises(AuthenticationError, match="failed its HMAC check"):
        server.recv()
    # a tampered frame on a fresh connection
    got, client = _pair("k" * 64, "k" * 64)
    frame = bytearray(_frame_signed(client, {"t": "req", "reqs": [9]}))
    frame[-3] ^= 0x01
    client.sock.sendall(bytes(frame))
    messages, alive = got["ch"].recv_available()
    assert messages == [] and alive is False
    assert isinstance(got["ch"].error, AuthenticationError)


def _frame_signed(ch, obj) -> bytes:
    captured: list[bytes] = []
    real = ch.sock
    ch.sock = type("S", (), {"sendall": lambda self, d: captured.append(d)})()
    try:
        ch.send(obj)
    finally:
        ch.sock = real
    return captured[0]


@pytest.mark.reliability(fault="a rank with the wrong secret", category="security")
@pytest.mark.timeout(30)
def test_a_wrong_secret_fails_the_handshake_on_both_sides_without_naming_it():
    from ringcore._auth import AuthenticationError

    got, client = _pair("right-" + "a" * 58, "wrong-" + "b" * 58)
    assert isinstance(got["error"], AuthenticationError)
    assert isinstance(client, AuthenticationError) and "refused rank 3" in str(client)
    for text in (str(got["error"]), str(client)):
        assert "right-" not in text and "wrong-" not in text
