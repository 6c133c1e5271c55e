"""CURVE keys for the relay's sockets: one place that makes and loads them (docs/MULTINODE.md).

A relay holds its own certificate and the collector's public key; the collector holds its own
certificate and a directory of the relays' public keys it admits.
"""

from __future__ import annotations

import os
from pathlib import Path

import zmq

from dpboard.errors import AlreadyExistsError, InvalidInputError, NotFoundError, UnavailableError

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
        public, secret = zmq.auth.load_certificate(p)
    except (ValueError, OSError) as e:
        raise InvalidInputError(f"{what} {p} is not a ZMQ certificate file: {e}") from None
    for which, key in (("public-key", public), ("secret-key", secret)):
        if key is not None and not _is_key(key):
            raise InvalidInputError(
                f"{what} {p}: its {which} is not a CURVE key (40 Z85 characters), got {key[:48]!r}: the file "
                f"is damaged; make a new pair with `dpboard relay --keygen DIR`")
    if public is None:
        raise InvalidInputError(f"{what} {p} holds no public-key: make a new pair with `dpboard relay --keygen DIR`")
    return public, secret


def _is_key(key: bytes) -> bool:
    from zmq.utils import z85

    if len(key) != 40:
        return False
    try:
        return len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        return False


def check_authorized_keys(directory: str | os.PathLike[str]) -> int:
    """Load every ``*.key`` in ``directory`` as ZMQ's authenticator will, before anything starts: one
    damaged file would otherwise let the collector start and then refuse every relay, the
    authorized ones included. Returns how many keys there are."""
    d = Path(directory)
    if not d.is_dir():
        raise NotFoundError(f"authorized keys directory {d} does not exist")
    files = sorted(d.glob("*.key"))
    for path in files:
        load_certificate(path, "authorized relay key")
    return len(files)


def generate_certificates(directory: str | os.PathLike[str], name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``name.key`` (public, 0644) and ``name.key_secret`` (0600) into ``directory``.

    An existing pair is kept unless ``force``: a key in use is never overwritten by mistake. The
    files are made in a private folder inside ``directory`` and then moved into place: nothing is
    written through a link planted in the directory, and no one can read the secret key meanwhile."""
    import shutil
    import tempfile

    import zmq.auth

    require_curve()
    if not name or "/" in name or name in (".", ".."):
        raise InvalidInputError(f"--key-name {name!r} must be a plain file name")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    existing = [p for p in (public, secret) if os.path.lexists(p)]
    if existing and not force:
        raise AlreadyExistsError(
            f"{', '.join(map(str, existing))} already exist: keys in use are not replaced; pick another "
            f"--key-name, or pass --force to replace them"
        )
    private = Path(tempfile.mkdtemp(prefix=".dpboard-keygen-", dir=d))  # mode 0700, a fresh name
    try:
        made_public, made_secret = (Path(p) for p in zmq.auth.create_certificates(private, name))
        os.chmod(made_secret, 0o600)
        os.chmod(made_public, 0o644)  # public keys are meant to be shared
        for made, final in ((made_secret, secret), (made_public, public)):
            if force:
                os.replace(made, final)  # replaces a link itself, never writes through it
            else:
                os.link(made, final)  # fails if the name appeared meanwhile: nothing is overwritten
    except FileExistsError:
        raise AlreadyExistsError(f"{public} or {secret} appeared while the keys were made; retry") from None
    finally:
        shutil.rmtree(private, ignore_errors=True)
    return public, secret
