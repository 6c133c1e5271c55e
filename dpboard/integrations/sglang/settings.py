"""The plugin's settings: environment variables, read when a process first needs them.

SGLang starts every process with ``spawn``, so each reads the environment it inherited from the
server's command line; nothing here is read at import (the plugin's entry point runs before SGLang
has published its own configuration).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dpboard.board import validate_name
from dpboard.board.stale import stale_after_from
from dpboard.controller.wave import DEFAULT_WAVE_HOLD, DEFAULT_WAVE_PER_RANK, MAX_WAVE_HOLD, MAX_WAVE_PER_RANK
from dpboard.errors import InvalidInputError
from dpboard.methods import LoadBalanceMethod, parse_load_balance_method
from dpboard.options import count, seconds

ENV_METHOD = "DPBOARD_METHOD"
ENV_STALE_AFTER = "DPBOARD_STALE_AFTER"
ENV_BOARD = "DPBOARD_BOARD"
ENV_WAVE_MAX_HOLD = "DPBOARD_WAVE_MAX_HOLD"  # inflight_wave: as the ZMQ controller's --wave-max-hold
ENV_WAVE_PER_RANK = "DPBOARD_WAVE_PER_RANK"  # inflight_wave: as --wave-per-rank

# SGLang publishes after every prefill batch, every 15th decode batch (load_snapshot_publish_interval)
# and about once a second while idle with --sleep-on-idle: a live rank can be silent for more than a
# second under a heavy decode batch, so the default is well above that.
DEFAULT_STALE_AFTER = 5.0
# SGLang's controller reads loads at most every 20 ms: a threshold below half of that has every rank
# stale between two reads. The ceiling is the board's own (a threshold in int64 nanoseconds).
MIN_STALE_AFTER = 0.01


@dataclass(frozen=True)
class PluginSettings:
    method: LoadBalanceMethod | str | None  # DPBOARD_METHOD: None = SGLang's own DPBudget dispatches
    stale_after: float  # seconds without a publish before a rank is handed to SGLang as unpublished
    board: str | None  # DPBOARD_BOARD: a fixed board name instead of one derived from the instance
    wave_max_hold: float = DEFAULT_WAVE_HOLD  # inflight_wave: the longest a request is held, less a group step
    wave_per_rank: int = DEFAULT_WAVE_PER_RANK  # inflight_wave: held requests per rank that fill a wave


def read_settings(environ: dict[str, str] | None = None) -> PluginSettings:
    env = os.environ if environ is None else environ
    raw_method = env.get(ENV_METHOD, "").strip()
    method = None
    if raw_method:
        try:
            method = parse_load_balance_method(raw_method)
        except InvalidInputError as e:
            raise InvalidInputError(f"{ENV_METHOD}={raw_method!r}: {e}; unset it to keep SGLang's own dispatch") from None
    stale_after = stale_after_from(env, ENV_STALE_AFTER, DEFAULT_STALE_AFTER, low=MIN_STALE_AFTER,
                                   why="below it every rank would read as stale between two publishes, above "
                                       "it a dead rank would never be noticed")
    raw_board = env.get(ENV_BOARD, "").strip() or None
    if raw_board is not None:
        try:
            validate_name(raw_board)
        except InvalidInputError as e:
            raise InvalidInputError(f"{ENV_BOARD}: {e}") from None
    return PluginSettings(method=method, stale_after=stale_after, board=raw_board,
                          wave_max_hold=_from_env(env, ENV_WAVE_MAX_HOLD, seconds(MAX_WAVE_HOLD, zero=True),
                                                  DEFAULT_WAVE_HOLD, "inflight_wave's longest hold, a share of the "
                                                                     "TTFT objective"),
                          wave_per_rank=_from_env(env, ENV_WAVE_PER_RANK, count(1, MAX_WAVE_PER_RANK), DEFAULT_WAVE_PER_RANK,
                                                  "inflight_wave's held requests per rank that fill a wave"))


def _from_env(env: Mapping[str, str], name: str, parse: Callable[[str], float], default: float, what: str) -> float:
    """``name``'s value read by ``parse`` (dpboard.options: the command line's own ranges), ``default``
    when unset or empty; else an InvalidInputError naming it."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        return parse(raw)
    except argparse.ArgumentTypeError as e:
        raise InvalidInputError(f"{name}={raw!r}: {e} ({what}); unset it for the default, {default:g}") from None
