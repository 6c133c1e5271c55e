"""The plugin's settings: environment variables, read when a process first needs them.

SGLang starts every process with ``spawn``, so each reads the environment it inherited from the
server's command line; nothing here is read at import (the plugin's entry point runs before SGLang
has published its own configuration).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from dpboard.board import validate_name
from dpboard.board.stale import stale_after_from
from dpboard.controller.methods import LoadBalanceMethod, parse_load_balance_method
from dpboard.errors import InvalidInputError

ENV_METHOD = "DPBOARD_METHOD"
ENV_STALE_AFTER = "DPBOARD_STALE_AFTER"
ENV_BOARD = "DPBOARD_BOARD"

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
    return PluginSettings(method=method, stale_after=stale_after, board=raw_board)
