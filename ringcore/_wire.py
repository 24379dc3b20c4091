"""Framing for the engine's control messages: length-prefixed JSON over TCP.

Control messages are small (names, shapes, dtypes); they are JSON, never pickles, so
a peer can make us parse but never execute. Bulk tensor data never travels here: it
goes through the backend (Gloo, MPI).
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import threading
from typing import Any

_HEADER = struct.Struct("!I")
MAX_MESSAGE = 64 << 20


class Channel:
    """One TCP connection carrying whole JSON messages; ``send`` is thread-safe."""

    def __init__(self, sock: socket.socket):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self._send_lock = threading.Lock()
        self._buf = bytearray()

    def send(self, message: Any) -> None:
        data = json.dumps(message, separators=(",", ":")).encode()
        with self._send_lock:
            self.sock.sendall(_HEADER.pack(len(data)) + data)

    def _fill(self, n: int) -> bool:
        while len(self._buf) < n:
            chunk = self.sock.recv(max(65536, n - len(self._buf)))
            if not chunk:
                return False
            self._buf += chunk
        return True

    def recv(self) -> Any | None:
        """The next message, or None when the peer closed the connection."""
        if not self._fill(_HEADER.size):
            return None
        (n,) = _HEADER.unpack_from(self._buf)
        if n > MAX_MESSAGE:
            raise ConnectionError(f"control message of {n} bytes exceeds {MAX_MESSAGE}")
        if not self._fill(_HEADER.size + n):
            return None
        data = bytes(self._buf[_HEADER.size : _HEADER.size + n])
        del self._buf[: _HEADER.size + n]
        return json.loads(data)

    def recv_available(self) -> tuple[list[Any], bool]:
        """Messages readable now without blocking (after select said readable); and
        whether the peer is still connected."""
        try:
            chunk = self.sock.recv(1 << 20)
        except BlockingIOError:
            return [], True
        except ConnectionError:
            return self._drain(), False
        if not chunk:
            return self._drain(), False
        self._buf += chunk
        return self._drain(), True

    def buffered(self) -> list[Any]:
        """Whole messages already read from the socket but not yet returned."""
        return self._drain()

    def _drain(self) -> list[Any]:
        out = []
        while len(self._buf) >= _HEADER.size:
            (n,) = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + n:
                break
            out.append(json.loads(bytes(self._buf[_HEADER.size : _HEADER.size + n])))
            del self._buf[: _HEADER.size + n]
        return out

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
