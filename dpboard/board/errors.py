"""The board's own errors."""

from __future__ import annotations

from dpboard.errors import DpboardError


class BoardError(DpboardError, RuntimeError):
    """A board cannot be created, attached or written as asked (the message says why and what to do)."""


class BoardLayoutError(BoardError):
    """The segment exists but has another layout version or shape than the caller expects."""
