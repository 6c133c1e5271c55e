"""The one error base of dpboard.

Every error dpboard raises on purpose (bad input, a board that cannot be used as asked, a frame
that fails validation, a busy endpoint, a missing GPU) is a ``DpboardError`` whose message says what
is wrong and what to do about it. The command line prints such an error as one line and exits with
status 2; anything else is a bug and shows its traceback.

Each kind also derives from the standard exception a caller would expect (``ValueError`` for bad
input, ``FileNotFoundError`` for a board that does not exist, ...), so ``except ValueError`` keeps
working where the API promises a ValueError.
"""

from __future__ import annotations


class DpboardError(Exception):
    """Base of every error dpboard raises on purpose."""


class InvalidInputError(DpboardError, ValueError):
    """An argument, a table, a request or a file's content is not acceptable."""


class NotFoundError(DpboardError, FileNotFoundError):
    """A board, file or key that was named does not exist."""


class AlreadyExistsError(DpboardError, FileExistsError):
    """Something that was to be created exists already."""


class AccessDeniedError(DpboardError, PermissionError):
    """A board or file belongs to someone this process may not act for."""


class UnavailableError(DpboardError, RuntimeError):
    """What the operation needs is not there now: no GPU, no rank that can take a request, a busy port."""
