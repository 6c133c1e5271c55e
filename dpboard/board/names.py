"""Board names and where their segments live."""

from __future__ import annotations

import re
from pathlib import Path

from dpboard.errors import InvalidInputError

SEGMENT_PREFIX = "dpboard."
SHM_DIR = Path("/dev/shm")
MAX_SLOTS = 65536
_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def validate_name(name: str) -> str:
    # fullmatch: a pattern ending in `$` would accept a trailing newline.
    if not isinstance(name, str) or not _NAME_RE.fullmatch(name):
        raise InvalidInputError(
            f"board name {name!r} is invalid: use 1-64 characters from letters, digits, '_', '.', '-'"
        )
    return name


def segment_name(name: str) -> str:
    """The POSIX shared-memory name of a board: ``/dpboard.<name>``."""
    return "/" + SEGMENT_PREFIX + validate_name(name)


def segment_path(name: str) -> Path:
    """Where the board's segment shows in the file system: ``/dev/shm/dpboard.<name>``."""
    return SHM_DIR / (SEGMENT_PREFIX + validate_name(name))
