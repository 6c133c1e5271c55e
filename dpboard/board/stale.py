"""The stale-after threshold: seconds without a publish before a slot reads as STALE.

One parser for every place it is given: the API (``Board.reader``, ``check_stale_after``), the
command line's ``--stale-after`` (``stale_after``, an argparse type), the plugins' environment
(``stale_after_from``). Its range is the C reader's: the reader keeps the threshold in whole
nanoseconds, 1..10**15, so 1e-9 s to 1e6 s.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping

from dpboard.errors import InvalidInputError
from dpboard.options import MAX_SECONDS, number

MIN_STALE_AFTER = 1e-9
MAX_STALE_AFTER = MAX_SECONDS


def check_stale_after(value: object, what: str = "stale_after", *, low: float = MIN_STALE_AFTER) -> float:
    """``value`` as a stale-after threshold in seconds, in [low, MAX_STALE_AFTER] (``low`` at least the
    C reader's 1 ns), or an InvalidInputError naming ``what``. Every stale-after passes here: the
    API's, the command line's (``stale_after``), the plugins' environment (``stale_after_from``)."""
    low = max(low, MIN_STALE_AFTER)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
            math.isfinite(value) and low <= value <= MAX_STALE_AFTER):
        raise InvalidInputError(f"{what} must be a number of seconds in [{low:g}, {MAX_STALE_AFTER:g}], got {value!r}")
    return float(value)


def stale_after(text: str) -> float:
    """``--stale-after``: seconds in [MIN_STALE_AFTER, MAX_STALE_AFTER] (``check_stale_after``'s range)."""
    value = number(text, float)
    try:
        return check_stale_after(value)
    except InvalidInputError:
        raise argparse.ArgumentTypeError(f"{text} is outside [{MIN_STALE_AFTER:g}, {MAX_STALE_AFTER:g}] seconds: "
                                         f"a reader keeps it in whole nanoseconds") from None


stale_after.__name__ = "float"  # argparse names the type in its messages


def stale_after_from(environ: Mapping[str, str], name: str, default: float, *, low: float = MIN_STALE_AFTER,
                     why: str = "") -> float:
    """The stale-after threshold in the environment variable ``name`` (``default`` when unset or
    empty), in ``check_stale_after``'s range from ``low``; else an InvalidInputError naming it."""
    raw = environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    try:
        return check_stale_after(value, low=low)
    except InvalidInputError:
        low = max(low, MIN_STALE_AFTER)
        raise InvalidInputError(f"{name}={raw!r} must be a number of seconds in [{low:g}, {MAX_STALE_AFTER:g}] "
                                f"(default {default:g})" + (f": {why}" if why else "")) from None
