"""Framing for the engine's control messages: length-prefixed JSON over TCP, with an HMAC.

Control messages are small (names, shapes, dtypes); they are JSON, never pickles, so
a peer can make us parse but never execute. Bulk tensor data never travels here: it
goes through the backend (Gloo, MPI).

Every connection starts with a handshake that proves both sides know the job's secret
(``_auth``) without sending it: the coordinator sends a random challenge, the rank
answers ``HMAC(secret, challenge, its nonce, its rank)``, the coordinator answers with
an HMAC over both nonces. Only then is anything else read, and from then on every
frame carries ``HMAC(session key, direction, sequence number, payload)``: a message
that fails it closes the connection, so a stranger can neither join nor inject nor
replay. Before the handshake completes a peer may send at most ``HANDSHAKE_MAX``
bytes of JSON per frame, after it ``MAX_MESSAGE``: a longer frame is never sent
(:class:`MessageTooLarge`), and one that arrives all the same ends the connection.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import select
import socket
import struct
import threading
import time
from typing import Any

from .. import _config as cfg
from .._auth import AuthenticationError, mac, new_nonce, session_key, verify
from .._errors import RendezvousError
from .._version import __version__

_HEADER = struct.Struct("!I")
_SEQ = struct.Struct("!Q")
_TAG = 32  # bytes of an HMAC-SHA256
MAX_MESSAGE = 64 << 20
HANDSHAKE_MAX = 4096
MAX_UNSIGNED_NESTING = 8  # a handshake message is one flat object: nothing nests deeper
HANDSHAKE_TIMEOUT_S = 10.0
PROTOCOL = 2  # 2: the challenge and the hello carry the ringtrain version


def ringtrain_version() -> str:
    """The ringtrain version this process announces in the handshake. The one reader of
    ``RING_TEST_FAKE_VERSION``, a test seam: set, the process claims that version."""
    return os.environ.get(cfg.TEST_FAKE_VERSION_ENV_VAR) or __version__


class VersionMismatch(RendezvousError):
    """A rank runs another ringtrain (or control protocol) than rank 0's coordinator."""

    def __init__(self, message: str, rank: int = -1):
        super().__init__(message)
        self.rank = rank

    def __reduce__(self):
        return (type(self), (str(self), self.rank))


def _version_mismatch(rank: int, theirs: tuple[Any, Any], ours: tuple[Any, Any]) -> str | None:
    """The error when rank ``rank``'s (version, protocol) differs from rank 0's; else None."""
    if tuple(theirs) == ours:
        return None

    def runs(version: Any, protocol: Any) -> str:
        if version is None:
            return "an older ringtrain (its handshake names no version)"
        return f"ringtrain {version} (control protocol {protocol})"

    return (
        f"rank {rank} runs {runs(*theirs)}, rank 0 runs {runs(*ours)}: install one version "
        "of ringtrain everywhere (every host, every Python environment of the job)"
    )


class MessageTooLarge(ValueError):
    """A control message over a channel's frame limit (:data:`MAX_MESSAGE` once the
    handshake is done): never sent, and refused where it is read."""


def bound_silence(sock: socket.socket, timeout_s: float | None = None) -> None:
    """Make a peer that stops answering (a partitioned or powered-off host, which sends
    no RST) fail this socket within about ``timeout_s`` (default
    ``RING_CONTROL_TIMEOUT_SECONDS``): keepalive probes while the connection is idle, and
    ``TCP_USER_TIMEOUT`` while sent data waits for an acknowledgement. Options the
    platform lacks are skipped (the bound then is the OS default)."""
    if timeout_s is None:
        timeout_s = cfg.control_timeout_s()
    if timeout_s <= 0:
        return  # 0: the OS defaults (hours)
    idle = max(1, int(timeout_s / 3))
    interval = max(1, int(timeout_s / 9))
    options = [
        (socket.SOL_SOCKET, getattr(socket, "SO_KEEPALIVE", None), 1),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPIDLE", None), idle),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPINTVL", None), interval),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_KEEPCNT", None), 6),
        (socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", None), int(timeout_s * 1000)),
    ]
    for level, option, value in options:
        if option is not None:
            with contextlib.suppress(OSError):
                sock.setsockopt(level, option, value)


class Channel:
    """One TCP connection carrying whole JSON messages; ``send`` is thread-safe. A peer
    that stops answering fails it within ``RING_CONTROL_TIMEOUT_SECONDS``
    (:func:`bound_silence`)."""

    def __init__(self, sock: socket.socket, max_message: int = MAX_MESSAGE):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bound_silence(sock)
        self.sock = sock
        self.max_message = max_message
        self._send_lock = threading.Lock()
        self._buf = bytearray()
        self._key: bytes | None = None
        self._out_dir, self._in_dir = b"", b""
        self._out_seq = self._in_seq = 0
        self._poller: Any = None  # made by the first recv with a timeout
        self.error: BaseException | None = None  # why the last drain stopped, if it did

    def __repr__(self) -> str:  # never shows a key
        return f"Channel(fd={self.sock.fileno()}, authenticated={self._key is not None})"

    def sign_with(self, key: bytes, *, send_dir: bytes, recv_dir: bytes) -> None:
        """From now on every frame sent carries an HMAC, and every frame read must."""
        self._key, self._out_dir, self._in_dir = key, send_dir, recv_dir

    def send(self, message: Any) -> None:
        self.send_encoded(encode(message))

    def send_encoded(self, data: bytes) -> None:
        """Send a message already made into JSON by :func:`encode` (one message sent to
        many channels is encoded once; each channel still signs it with its own key)."""
        with self._send_lock:
            if self._key is not None:
                seq = _SEQ.pack(self._out_seq)
                self._out_seq += 1
                data = hmac.digest(self._key, self._out_dir + seq + data, hashlib.sha256) + data
            if len(data) > self.max_message:  # the peer would refuse it: send nothing
                if self._key is not None:
                    self._out_seq -= 1
                raise MessageTooLarge(
                    f"a control message of {len(data)} bytes is over the limit of "
                    f"{self.max_message} bytes"
                )
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _decode(self, frame: bytes) -> Any:
        if self._key is not None:
            tag, data = frame[:_TAG], frame[_TAG:]
            seq = _SEQ.pack(self._in_seq)
            expected = hmac.digest(self._key, self._in_dir + seq + data, hashlib.sha256)
            if not hmac.compare_digest(tag, expected):
                raise AuthenticationError(
                    f"a control message from {_peer(self.sock)} failed its HMAC check "
                    "(forged, replayed or corrupted); closing the connection"
                )
            self._in_seq += 1
            frame = data
        else:  # before the handshake: a stranger's bytes, never handed to a recursive parser
            _refuse_deep_nesting(frame, MAX_UNSIGNED_NESTING)
        return json.loads(frame)

    def _fill(self, n: int, deadline: float | None = None) -> bool:
        while len(self._buf) < n:
            if deadline is not None and not self._readable_by(deadline):
                raise TimeoutError(f"{_peer(self.sock)} sent nothing in time")
            chunk = self.sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                return False
            self._buf += chunk
        return True

    def _readable_by(self, deadline: float) -> bool:
        if self._poller is None:  # poll, not select: fine with descriptors past 1024
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        left_ms = max(0, int((deadline - time.monotonic()) * 1000))
        return bool(self._poller.poll(left_ms))

    def _frame_size(self) -> int:
        (n,) = _HEADER.unpack_from(self._buf)
        if n > self.max_message:
            raise MessageTooLarge(
                f"a control message of {n} bytes from {_peer(self.sock)} is over the limit "
                f"of {self.max_message} bytes"
            )
        return n

    def recv(self, timeout_s: float | None = None) -> Any | None:
        """The next message, or None when the peer closed the connection.

        ``timeout_s``: :class:`TimeoutError` when no whole message arrived within it
        (what did arrive is kept for the next call); None waits for ever."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        if not self._fill(_HEADER.size, deadline):
            return None
        n = self._frame_size()
        if not self._fill(_HEADER.size + n, deadline):
            return None
        data = bytes(self._buf[_HEADER.size : _HEADER.size + n])
        del self._buf[: _HEADER.size + n]
        return self._decode(data)

    def recv_available(self) -> tuple[list[Any], bool]:
        """Messages readable now without blocking (after select said readable); and
        whether the peer is still connected (False also after a frame failed its HMAC)."""
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            return [], True
        except OSError as exc:  # reset, timed out (keepalive), host unreachable, ...
            self.error = exc
            return self._drain()[0], False
        if not chunk:
            return self._drain()[0], False
        self._buf += chunk
        return self._drain()

    def buffered(self) -> tuple[list[Any], bool]:
        """Whole messages already read from the socket but not yet returned; and False
        when one failed its check."""
        return self._drain()

    def _drain(self) -> tuple[list[Any], bool]:
        out = []
        try:
            while len(self._buf) >= _HEADER.size:
                n = self._frame_size()
                if len(self._buf) < _HEADER.size + n:
                    break
                frame = bytes(self._buf[_HEADER.size : _HEADER.size + n])
                del self._buf[: _HEADER.size + n]
                out.append(self._decode(frame))
        except (ConnectionError, ValueError, RecursionError) as exc:  # RecursionError: nested JSON
            self.error = exc
            self._buf.clear()
            return out, False
        return out, True

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


def _refuse_deep_nesting(frame: bytes, limit: int) -> None:
    """Raise ValueError when the JSON in ``frame`` nests arrays or objects deeper than
    ``limit``. ``json.loads`` recurses once per level: a frame of a few thousand ``[``
    would run it to the interpreter's recursion limit, and anything the garbage collector
    finalizes at that depth fails too. Brackets inside strings do not count."""
    if frame.count(b"[") + frame.count(b"{") <= limit:
        return
    depth = 0
    in_string = escaped = False
    for byte in frame:
        if in_string:
            if escaped:
                escaped = False
            elif byte == 0x5C:  # backslash
                escaped = True
            elif byte == 0x22:  # closing quote
                in_string = False
        elif byte == 0x22:
            in_string = True
        elif byte in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > limit:
                raise ValueError(f"a control frame nests deeper than {limit} levels")
        elif byte in (0x5D, 0x7D):  # ] }
            depth -= 1


def encode(message: Any) -> bytes:
    """A message as the JSON bytes a frame carries."""
    return json.dumps(message, separators=(",", ":")).encode()


def _peer(sock: socket.socket) -> str:
    try:
        host, port = sock.getpeername()[:2]
        return f"{host}:{port}"
    except OSError:
        return "a closed peer"


def _hello_mac(secret: str, server_nonce: str, client_nonce: str, rank: int) -> str:
    return mac(secret, "ringcore/hello", server_nonce, client_nonce, str(rank)).hex()


def _welcome_mac(secret: str, server_nonce: str, client_nonce: str, rank: int) -> str:
    return mac(secret, "ringcore/welcome", server_nonce, client_nonce, str(rank)).hex()


def _denied_mac(secret: str, server_nonce: str, client_nonce: str, rank: int, why: str) -> str:
    return mac(secret, "ringcore/denied", server_nonce, client_nonce, str(rank), why).hex()


def accept_handshake(
    sock: socket.socket, secret: str, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> tuple[int, Channel]:
    """The coordinator's side: challenge the peer; its rank and a signed channel, or
    :class:`AuthenticationError` (the socket is then closed, nothing it sent was used),
    or :class:`VersionMismatch` for a peer that knows the secret but runs another
    ringtrain version (it is told why, then closed)."""
    peer = _peer(sock)
    sock.settimeout(timeout_s)
    ch = Channel(sock, max_message=HANDSHAKE_MAX)
    server_nonce = new_nonce()
    try:
        ours = (ringtrain_version(), PROTOCOL)
        ch.send({"t": "challenge", "v": PROTOCOL, "ver": ours[0], "nonce": server_nonce})
        hello = ch.recv()
        rank = hello.get("rank") if isinstance(hello, dict) else None
        nonce = hello.get("nonce") if isinstance(hello, dict) else None
        ok = (
            isinstance(hello, dict)
            and hello.get("t") == "hello"
            and type(rank) is int
            and isinstance(nonce, str)
            and 0 < len(nonce) <= 128
            and verify(_hello_mac(secret, server_nonce, nonce, rank), hello.get("mac"))
        )
        if not ok:
            with contextlib.suppress(OSError):
                ch.send({"t": "denied"})
            raise AuthenticationError(
                f"a control connection from {peer} did not prove it knows the job's secret"
            )
        assert isinstance(rank, int) and isinstance(nonce, str) and isinstance(hello, dict)
        # a peer that knows the secret is one of the job's ranks: tell it why it is refused
        mismatch = _version_mismatch(rank, (hello.get("ver"), hello.get("v")), ours)
        if mismatch:
            denied_mac = _denied_mac(secret, server_nonce, nonce, rank, mismatch)
            with contextlib.suppress(OSError):
                ch.send({"t": "denied", "why": mismatch, "mac": denied_mac})
            ch.close()
            raise VersionMismatch(mismatch, rank)
        ch.send({"t": "welcome", "mac": _welcome_mac(secret, server_nonce, nonce, rank)})
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested JSON
        ch.close()
        if isinstance(exc, AuthenticationError):
            raise
        raise AuthenticationError(
            f"the handshake with {peer} failed ({type(exc).__name__})"
        ) from None
    ch.sign_with(session_key(secret, server_nonce, nonce, rank), send_dir=b"S", recv_dir=b"C")
    ch.max_message = MAX_MESSAGE
    sock.settimeout(None)
    return rank, ch


def connect_handshake(
    sock: socket.socket, secret: str, rank: int, timeout_s: float = HANDSHAKE_TIMEOUT_S
) -> Channel:
    """A rank's side: answer the coordinator's challenge, check that it knows the secret
    too, and return the signed channel; :class:`AuthenticationError` otherwise, and
    :class:`VersionMismatch` when this rank and rank 0 run different ringtrain versions."""
    peer = _peer(sock)
    sock.settimeout(timeout_s)
    ch = Channel(sock, max_message=HANDSHAKE_MAX)
    try:
        challenge = ch.recv()
        if not isinstance(challenge, dict) or challenge.get("t") != "challenge":
            raise AuthenticationError(f"{peer} did not send a ringcore coordinator's challenge")
        server_nonce = challenge.get("nonce")
        if not isinstance(server_nonce, str):
            raise AuthenticationError(f"{peer} did not send a ringcore coordinator's challenge")
        nonce = new_nonce()
        ch.send(
            {
                "t": "hello",
                "rank": rank,
                "nonce": nonce,
                "mac": _hello_mac(secret, server_nonce, nonce, rank),
                "v": PROTOCOL,
                "ver": ringtrain_version(),
            }
        )
        reply = ch.recv()
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: nested JSON
        ch.close()
        if isinstance(exc, AuthenticationError):
            raise
        raise AuthenticationError(
            f"the handshake with the coordinator at {peer} failed ({type(exc).__name__})"
        ) from None
    denial = reply if isinstance(reply, dict) and reply.get("t") == "denied" else {}
    why = denial.get("why")
    if isinstance(why, str) and verify(
        _denied_mac(secret, server_nonce, nonce, rank, why), denial.get("mac")
    ):
        ch.close()  # the coordinator (it knows the secret) refused this rank's version
        raise VersionMismatch(f"{why} (refused by the coordinator at {peer})", rank)
    if not isinstance(reply, dict) or reply.get("t") != "welcome":
        ch.close()
        raise AuthenticationError(
            f"the coordinator at {peer} refused rank {rank}: the ranks do not share one job "
            "secret. Launch every rank with the same RING_SECRET_KEY (or none: rank 0 then "
            "makes one)"
        )
    if not verify(_welcome_mac(secret, server_nonce, nonce, rank), reply.get("mac")):
        ch.close()
        raise AuthenticationError(
            f"{peer} answered like a coordinator but does not know the job's secret"
        )
    # an older coordinator welcomes any version: refuse it from this side
    ours = (ringtrain_version(), PROTOCOL)
    mismatch = _version_mismatch(rank, ours, (challenge.get("ver"), challenge.get("v")))
    if mismatch:
        ch.close()
        raise VersionMismatch(mismatch, rank)
    ch.sign_with(session_key(secret, server_nonce, nonce, rank), send_dir=b"C", recv_dir=b"S")
    ch.max_message = MAX_MESSAGE
    sock.settimeout(None)
    return ch
