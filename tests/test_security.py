"""The engine's control connection lets in only ranks that know the job's secret.

A rogue client (this test process, which does not know the secret) connects to rank 0's
coordinator while the job starts: it is refused and closed, the requests it sent are
never executed, and the job goes on with correct results. A rank with a wrong secret
cannot join either. The secret never shows in output, log records, exceptions, reprs
or the store.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
from _reliability import record

from ringcore import RendezvousError
from ringcore.testing import run_workers

_HEADER = struct.Struct("!I")


# -- the workers ------------------------------------------------------------------------


def _hold_rank_1_until(go: Path, addr_file: Path) -> list[str]:
    """Seam: rank 0 publishes the coordinator's address, rank 1 connects only once the
    test says go (so the rogue client is at the port before the job is complete).
    Returns the list every executed response name is recorded into."""
    import ringcore._engine as eng

    executed: list[str] = []
    orig_init, orig_execute = eng.Engine.__init__, eng.Engine._execute

    def init(self, backend, rank, size, addr, *args, **kwargs):
        if rank == 0:
            addr_file.write_text(json.dumps(list(addr)))
        else:
            deadline = time.monotonic() + 60
            while not go.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
        orig_init(self, backend, rank, size, addr, *args, **kwargs)

    def execute(self, item):
        executed.extend(e.get("n", "?") for e in item.get("e", []))
        return orig_execute(self, item)

    eng.Engine.__init__ = init  # type: ignore[method-assign]
    eng.Engine._execute = execute  # type: ignore[method-assign]
    return executed


def _rogue_target_worker(tmp: str):
    import torch

    import ringcore._runtime as rt
    import ringcore.torch as hvd

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
        out["refused"] = rt._state.coordinator.refused
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
    import datetime
    import logging

    import torch
    import torch.distributed as dist

    import ringcore._runtime as rt
    import ringcore.torch as hvd

    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, rec):
            records.append(rec)

    logger = logging.getLogger("ringtrain")
    logger.setLevel(logging.DEBUG)
    logger.addHandler(Keep())
    logger.addHandler(logging.StreamHandler())  # and to stderr, which the test captures
    texts: list[str] = []
    secrets_seen = [secret]
    for fallback in (False, True):
        if fallback:  # no secret from the launcher: rank 0 makes one
            del os.environ["RING_SECRET_KEY"]
        hvd.init()
        r = hvd.rank()
        if fallback and r == 0:
            secrets_seen.append(rt._state.coordinator._secret)
        texts += [repr(rt._state), repr(rt._state.engine.channel), repr(rt._state.coordinator)]
        x = hvd.allreduce(torch.ones(2), op=hvd.Sum, name="ok")
        assert x.tolist() == [2.0, 2.0]
        try:  # an error message that goes through every layer
            hvd.allreduce(torch.ones(2 + r), name="mismatch")
        except Exception as exc:
            texts += [str(exc), repr(exc)]
        print(f"rank {r} environment keys: {sorted(k for k in os.environ if 'RING' in k)}")
        hvd.shutdown()
    store = dist.TCPStore("127.0.0.1", store_port, 2, False, timeout=datetime.timedelta(seconds=10))
    values = [k for k in store.list_keys()]
    values += [store.get(k).decode(errors="replace") for k in values]
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


# -- the handshake and the per-message HMAC, in one process ---------------------------------


def _pair(server_secret: str, client_secret: str):
    from ringcore._wire import accept_handshake, connect_handshake

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
