"""The step log's two settings, read from the environment of the engine's process.

``DPBOARD_STEP_LOG=DIR`` turns the step recorder on: every scheduler writes its steps into a file of
its own in DIR (an existing directory this process may write). ``DPBOARD_STEP_LOG_MAX_MIB`` caps each
file (default 64 MiB: about 930,000 steps); past the cap, steps are counted, not written.

A bad value is an ``InvalidInputError`` naming the variable and the fix, raised where the engine's
process reads it at its start (the SGLang scheduler's ``__init__``, vLLM's plugin registration).
"""

from __future__ import annotations

import argparse
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dpboard.errors import InvalidInputError
from dpboard.options import count

ENV_STEP_LOG = "DPBOARD_STEP_LOG"
ENV_MAX_MIB = "DPBOARD_STEP_LOG_MAX_MIB"
DEFAULT_MAX_MIB = 64
MAX_MAX_MIB = 1 << 20  # 1 TiB per file
MIB = 1 << 20


@dataclass(frozen=True)
class StepLogSettings:
    directory: Path  # where each scheduler writes its file
    max_bytes: int  # the cap of one file, its prelude and header included


def step_log_settings(environ: Mapping[str, str] | None = None) -> StepLogSettings | None:
    """The step log's settings, None when ``DPBOARD_STEP_LOG`` is unset or empty; an InvalidInputError
    naming the variable when DIR is not a directory this process can write, or the cap is not a size."""
    env = os.environ if environ is None else environ
    raw = env.get(ENV_STEP_LOG, "").strip()
    if not raw:
        return None
    directory = Path(raw).expanduser()
    unset = f"or unset {ENV_STEP_LOG} to record no steps"
    try:
        st = directory.stat()
    except FileNotFoundError:
        raise InvalidInputError(f"{ENV_STEP_LOG}={raw!r}: no such directory; create it (mkdir -p {raw}) "
                                f"{unset}") from None
    except OSError as e:
        raise InvalidInputError(f"{ENV_STEP_LOG}={raw!r}: this process (uid {os.geteuid()}) cannot reach that "
                                f"directory ({e.strerror}); name one it can write {unset}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidInputError(f"{ENV_STEP_LOG}={raw!r} is not a directory: name a directory for the step "
                                f"logs (each scheduler writes its own file in it) {unset}")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise InvalidInputError(f"{ENV_STEP_LOG}={raw!r}: this process (uid {os.geteuid()}) cannot write in "
                                f"that directory; name one it can write (or chmod it) {unset}")
    raw_cap = env.get(ENV_MAX_MIB, "").strip()
    max_mib = DEFAULT_MAX_MIB
    if raw_cap:
        try:
            max_mib = count(1, MAX_MAX_MIB)(raw_cap)
        except argparse.ArgumentTypeError as e:
            raise InvalidInputError(f"{ENV_MAX_MIB}={raw_cap!r}: {e} (each step log's size cap in MiB); unset it "
                                    f"for the default, {DEFAULT_MAX_MIB}") from None
    return StepLogSettings(directory=directory.absolute(), max_bytes=int(max_mib) * MIB)
