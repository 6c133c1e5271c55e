"""CURVE keys for the relay's sockets: one place that makes and loads them (docs/MULTINODE.md).

A relay holds its own certificate and the collector's public key; the collector holds its own
certificate and a directory of the relays' public keys it admits.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from dpboard.errors import InvalidInputError, NotFoundError, UnavailableError

_NO_CURVE = (
    "CURVE security was asked for, but this libzmq has no CURVE support: install a pyzmq wheel "
    "(they bundle libsodium) or a libzmq built with libsodium"
)


def require_curve() -> None:
    if not zmq.has("curve"):
        raise UnavailableError(_NO_CURVE)


def load_certificate(path: str | os.PathLike[str], what: str) -> tuple[bytes, bytes | None]:
    """(public, secret) keys of a ZMQ certificate file; secret is None for a public-only file."""
    import zmq.auth

    require_curve()
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(
            f"{what} {p} does not exist: create keys with `dpboard relay --keygen DIR` (see docs/MULTINODE.md)"
        )
    try:
        return zmq.auth.load_certificate(p)
    except (ValueError, OSError) as e:
        raise InvalidInputError(f"{what} {p} is not a ZMQ certificate file: {e}") from None


def generate_certificates(directory: str | os.PathLike[str], name: str) -> tuple[Path, Path]:
    """Write ``name.key`` (public) and ``name.key_secret`` (mode 0600) into ``directory``."""
    import zmq.auth

    require_curve()
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    old_umask = os.umask(0o077)  # the secret key is never readable by others, not even for a moment
    try:
        public, secret = zmq.auth.create_certificates(d, name)
    finally:
        os.umask(old_umask)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)  # public keys are meant to be shared
    return Path(public), Path(secret)
