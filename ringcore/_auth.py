"""The per-job secret and the HMAC-SHA256 checks every socket of ours uses.

A launcher makes one secret per job (:func:`new_secret`) and hands it to every rank in
``RING_SECRET_KEY`` (:func:`ringcore.worker_env` ``secret=``); it never travels on our
sockets: peers prove they know it by answering a random challenge with an HMAC
(:func:`answer`), and the engine's control messages then carry an HMAC each, keyed by
a session key derived from the secret and both sides' nonces (:func:`session_key`).
Every comparison is constant-time (:func:`hmac.compare_digest`).

The secret is kept out of logs, exceptions and reprs: nothing here formats it, and
:class:`AuthenticationError` messages name the peer, never a key or a digest.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from . import _config as cfg

__all__ = [
    "AuthenticationError",
    "answer",
    "job_secret",
    "mac",
    "new_secret",
    "session_key",
    "verify",
]

NONCE_BYTES = 16


class AuthenticationError(ConnectionError):
    """A peer did not prove it knows the job's secret (or a message failed its HMAC)."""


def new_secret() -> str:
    """A fresh per-job secret: 256 random bits as hex."""
    return secrets.token_hex(32)


def new_nonce() -> str:
    return secrets.token_hex(NONCE_BYTES)


def job_secret() -> str | None:
    """The job's secret from ``RING_SECRET_KEY`` (or ``HOROVOD_SECRET_KEY``); None if unset."""
    value = cfg.get_env(cfg.SECRET_KEY_ENV_VAR)
    return value or None


def _bytes(value: str | bytes) -> bytes:
    return value if isinstance(value, bytes) else value.encode()


def mac(key: str | bytes, *parts: str | bytes) -> bytes:
    """HMAC-SHA256 of ``parts`` (length-prefixed, so no two part lists collide)."""
    msg = b"".join(len(p).to_bytes(4, "big") + p for p in map(_bytes, parts))
    return hmac.digest(_bytes(key), msg, hashlib.sha256)


def verify(expected: str | bytes, got: object) -> bool:
    """Constant-time comparison; False for anything that is not a str/bytes of the same kind."""
    if isinstance(expected, str):
        # as UTF-8 bytes: compare_digest raises TypeError on a non-ASCII str (a stranger's
        # MAC must be refused, never crash the handshake)
        return isinstance(got, str) and hmac.compare_digest(_bytes(expected), _bytes(got))
    return isinstance(got, bytes) and hmac.compare_digest(expected, got)


def answer(secret: str, challenge: str) -> str:
    """The hex HMAC a client sends back for a server's ``challenge`` (spark_runner's log
    server), under its own domain label: no other use of the secret yields the same MAC."""
    return mac(secret, "ringtrain/log-server", challenge).hex()


def session_key(secret: str, server_nonce: str, client_nonce: str, rank: int) -> bytes:
    """The key that signs one control connection's messages after its handshake."""
    return mac(secret, "ringcore/session", server_nonce, client_nonce, str(rank))
