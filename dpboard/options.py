"""Argument types for the command line: every numeric option is range-checked by the parser.

``type=seconds()`` and friends turn a value that is not a number, or is outside its range (``inf``,
``nan``, ``1e10`` seconds, a negative queue length), into argparse's own one-line error and exit
status 2, before any command starts.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable

MAX_SECONDS = 1e6  # about 11.6 days: longer thresholds and periods are mistakes, and must fit int64 ns
MAX_COUNT = 2**31 - 1


def number(text: str, kind: type) -> float | int:
    try:
        value = kind(text)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None
    if kind is float and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not a finite number")
    return value


def number_in(kind: type, low: float, high: float, *, low_open: bool = False, unit: str = "",
              hint: str = "") -> Callable[[str], float]:
    """A parser of numbers of ``kind`` in [low, high] (``low_open``: (low, high]); ``hint`` follows the
    error."""
    left = "(" if low_open else "["
    fmt = "{}" if kind is int else "{:g}"
    described = f"{left}{fmt.format(low)}, {fmt.format(high)}]" + (f" {unit}" if unit else "")

    def parse(text: str) -> float | int:
        value = number(text, kind)
        if value < low or (low_open and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"{text} is outside {described}" + (f": {hint}" if hint else ""))
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def seconds(high: float = MAX_SECONDS, *, zero: bool = False) -> Callable[[str], float]:
    """A duration or threshold in seconds: finite, > 0 (>= 0 with ``zero``), at most ``high``."""
    return number_in(float, 0.0, high, low_open=not zero, unit="seconds")


def milliseconds(high: float = MAX_SECONDS * 1e3) -> Callable[[str], float]:
    return number_in(float, 0.0, high, low_open=True, unit="milliseconds")


def count(low: int = 1, high: int = MAX_COUNT, *, hint: str = "") -> Callable[[str], int]:
    """An integer in [low, high]."""
    return number_in(int, low, high, hint=hint)


def fraction() -> Callable[[str], float]:
    """A share in [0, 1]."""
    return number_in(float, 0.0, 1.0)


def positive(high: float = 1e12) -> Callable[[str], float]:
    """A finite number > 0 (a rate, a factor)."""
    return number_in(float, 0.0, high, low_open=True)


def output_file(text: str) -> str:
    """A file to be written after a long run: its folder must exist and be writable now, so that a
    mistyped path is refused before the run instead of losing its figures after it."""
    folder = os.path.dirname(os.path.abspath(text)) or "."
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text} is a directory: name a file in it")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: the folder {folder} does not exist; create it or name another")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise argparse.ArgumentTypeError(f"{text}: not writable by this user; name a file in a folder you own")
    return text
