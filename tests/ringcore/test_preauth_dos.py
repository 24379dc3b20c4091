"""What a stranger can do before it authenticates: nothing but be refused and counted.

The engine's coordinator and spark_runner's log server accept connections from anyone
who reaches their port. A malformed frame (a non-ASCII MAC, JSON nested past Python's
recursion limit), a flood of silent connections or an ``accept()`` that fails (EMFILE)
must never kill the thread that serves the job, and closing the log server must not
wait for each slow peer in turn. Over socketpairs and 127.0.0.1 only.
"""

from __future__ import annotations

import errno
import io
import json
import socket
import struct
import threading
import time

import _spark
import pytest
from _reliability import record

from ringcore._auth import AuthenticationError, verify
from ringcore.engine.wire import HANDSHAKE_MAX, Channel, _refuse_deep_nesting, accept_handshake
from ringcore.launch import MAX_HANDSHAKES, LogConnection, LogServer

SHARED_SPARK = True  # on the suite's shared local[2] session (tests/_spark.py)

SECRET = "s" * 64
_HEADER = struct.Struct("!I")


def _tcp_pair() -> tuple[socket.socket, socket.socket]:
    """Two ends of one TCP connection on 127.0.0.1 (the channel sets TCP options)."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        server, _ = listener.accept()
    return server, client


def _handshake_with(hello: bytes) -> BaseException | None:
    """The coordinator's side of a handshake against a peer that sends ``hello`` (raw
    JSON bytes) after the challenge; what ``accept_handshake`` raised."""
    server, client = _tcp_pair()
    outcome: list[BaseException | None] = []

    def serve():
        try:
            accept_handshake(server, SECRET, timeout_s=5)
            outcome.append(None)
        except BaseException as exc:
            outcome.append(exc)

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        Channel(client, max_message=HANDSHAKE_MAX).recv()  # the challenge
        client.sendall(_HEADER.pack(len(hello)) + hello)
        thread.join(timeout=10)
    finally:
        client.close()
    assert not thread.is_alive()
    return outcome[0]


def test_verify_refuses_a_non_ascii_mac_instead_of_raising():
    assert verify("ab" * 32, "é" * 64) is False
    assert verify("ab" * 32, "ab" * 32) is True
    assert verify(b"ab", "ab") is False


@pytest.mark.reliability(
    fault="malformed pre-auth frames (non-ASCII MAC, nested JSON)", category="security"
)
def test_a_non_ascii_mac_in_the_hello_is_refused_as_an_authentication_error():
    hello = json.dumps({"t": "hello", "rank": 0, "nonce": "n", "mac": "é" * 64}).encode()
    assert isinstance(_handshake_with(hello), AuthenticationError)


@pytest.mark.reliability(
    fault="malformed pre-auth frames (non-ASCII MAC, nested JSON)", category="security"
)
def test_json_nested_past_the_recursion_limit_is_refused_as_an_authentication_error():
    hello = b"[" * (HANDSHAKE_MAX - 8)  # under the pre-auth size limit, nested ~4000 deep
    assert isinstance(_handshake_with(hello), AuthenticationError)


def test_nesting_is_refused_before_the_parser_recurses_and_brackets_in_strings_do_not_count(
    monkeypatch,
):
    deep = b"[" * 9 + b"]" * 9
    with pytest.raises(ValueError, match="nests deeper than 8"):
        _refuse_deep_nesting(deep, 8)
    _refuse_deep_nesting(b"[" * 8 + b"]" * 8, 8)  # at the limit: parsed as usual
    in_strings = json.dumps({"t": "hello", "nonce": "[" * 100, "mac": '\\"{' * 50}).encode()
    _refuse_deep_nesting(in_strings, 8)
    # a deep pre-auth frame never reaches the recursive parser at all
    parsed: list[bytes] = []
    real_loads = json.loads

    def spy(doc, *args, **kwargs):
        parsed.append(doc)
        return real_loads(doc, *args, **kwargs)

    monkeypatch.setattr(json, "loads", spy)
    assert isinstance(_handshake_with(b"{" * 3000), AuthenticationError)
    assert all(b"{" * 100 not in bytes(doc) for doc in parsed)


def test_a_signed_channel_drops_a_nested_frame_and_says_why():
    a, b = _tcp_pair()
    try:
        frame = b"[" * 5000
        a.sendall(_HEADER.pack(len(frame)) + frame)
        b.setblocking(False)
        time.sleep(0.1)
        messages, alive = Channel(b).recv_available()
        assert (messages, alive) == ([], False)
    finally:
        a.close()
        b.close()


@pytest.mark.reliability(
    fault="a connection flood / slow peers at the log server", category="security"
)
def test_silent_connections_beyond_the_cap_are_hung_up_on_and_the_server_serves_after(request):
    out = io.StringIO()
    server = LogServer(out, io.StringIO())
    strangers = []
    try:
        started = time.monotonic()
        for _ in range(MAX_HANDSHAKES + 10):
            strangers.append(socket.create_connection(("127.0.0.1", server.port)))
        deadline = time.monotonic() + 10
        while server.refused < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.refused >= 10
        for sock in strangers:  # the flood stops: its handshakes end, the slots free up
            sock.close()
        time.sleep(0.5)
        task = LogConnection("127.0.0.1", server.port, server.secret, 0, "w-1")
        task.send("O", "hello from the task")
        task.close()
        deadline = time.monotonic() + 10
        while "hello from the task" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "hello from the task" in out.getvalue()
        record(request, detect_s=time.monotonic() - started, cases=MAX_HANDSHAKES + 10)
    finally:
        for sock in strangers:
            sock.close()
        server.close(drain_s=1.0)


@pytest.mark.reliability(
    fault="a connection flood / slow peers at the log server", category="security"
)
def test_closing_the_log_server_waits_for_slow_peers_together_not_one_after_another():
    server = LogServer(io.StringIO(), io.StringIO())
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(5)]
    try:
        time.sleep(0.3)  # every reader is in its handshake, waiting for an answer
        started = time.monotonic()
        server.close(drain_s=1.0)
        assert time.monotonic() - started < 3.0  # 5 peers x 1 s before
    finally:
        for sock in slow:
            sock.close()


class _FailingOnce:
    """The log server's listener, whose next ``accept()`` fails as with EMFILE."""

    def __init__(self, listener: socket.socket):
        self._listener, self.failed = listener, False

    def accept(self):
        if not self.failed:
            self.failed = True
            raise OSError(errno.EMFILE, "Too many open files")
        return self._listener.accept()

    def close(self):
        self._listener.close()


def test_the_log_server_keeps_accepting_after_accept_fails_with_emfile():
    out = io.StringIO()
    server = LogServer(out, io.StringIO())
    failing = _FailingOnce(server._listener)
    server._listener = failing  # type: ignore[assignment]
    try:
        time.sleep(0.8)  # the loop's next accept() (0.5 s timeout) hits the failure
        assert failing.failed
        task = LogConnection("127.0.0.1", server.port, server.secret, 0, "w-1")
        task.send("O", "after the failure")
        task.close()
        deadline = time.monotonic() + 10
        while "after the failure" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "after the failure" in out.getvalue()
    finally:
        server.close(drain_s=1.0)


def _secret_of_worker():
    import os

    import torch

    import ringcore.torch as hvd
    from ringcore.torch import elastic

    hvd.init()
    state = elastic.ObjectState(steps=0)

    @elastic.run
    def train(state):
        hvd.allreduce(torch.ones(1), name="x")
        state.commit()
        return os.environ.get("RING_SECRET_KEY", "")

    return train(state)


@pytest.mark.spark
@pytest.mark.slow
def test_run_elastic_gives_every_worker_one_job_secret():
    import spark_runner

    _spark.shared_session()  # not stopped here: see tests/_spark.py
    secrets = spark_runner.run_elastic(_secret_of_worker, num_proc=2, stdout=io.StringIO())
    assert len(secrets) == 2 and secrets[0] == secrets[1] and len(secrets[0]) >= 32
