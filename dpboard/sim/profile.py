"""Rank profiles: a rank model's step costs and capacities, named and sourced, in small text files.

A profile file is ``key = value`` lines; ``#`` starts a comment (the sources go there). Keys, with
their units in the name:

========================  =====================================================================
``name``                  the profile's name (``--profile NAME``)
``description``           one line: model, precision, GPU, engine settings
``source``                one line: where the figures come from (details in the comments)
``kv_capacity_tokens``    KV pool per rank, tokens (the prefix cache lives in it)
``max_running_requests``  running batch limit per rank
``chunked_prefill_size``  prompt tokens per prefill step; 0 turns chunking off
``max_prefill_tokens``    with chunking off, prompt tokens per step (optional, default 16384)
``prefill_step_ms``       fixed cost of a prefill step
``prefill_token_us``      cost per prompt token computed
``decode_step_ms``        fixed cost of a decode step
``decode_request_us``     decode cost per request in the batch
``decode_kv_token_ns``    decode cost per KV token the batch holds
========================  =====================================================================

The profiles shipped with dpboard are in ``dpboard/sim/profiles/``; ``load_profile_file`` reads a
user's own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from dpboard.errors import InvalidInputError, NotFoundError
from dpboard.sim.model import RankConfig

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
SUFFIX = ".profile"

# key -> (RankConfig field, divisor to the field's unit, whole number?). Dividing by an exact power of
# ten gives the same float as the literal in seconds (40 us -> 40e-6 exactly).
_NUMERIC: dict[str, tuple[str, float, bool]] = {
    "kv_capacity_tokens": ("kv_capacity", 1, True),
    "max_running_requests": ("max_running", 1, True),
    "chunked_prefill_size": ("chunked_prefill_size", 1, True),
    "max_prefill_tokens": ("max_prefill_tokens", 1, True),
    "prefill_step_ms": ("prefill_base_s", 1e3, False),
    "prefill_token_us": ("prefill_s_per_token", 1e6, False),
    "decode_step_ms": ("decode_base_s", 1e3, False),
    "decode_request_us": ("decode_s_per_request", 1e6, False),
    "decode_kv_token_ns": ("decode_s_per_kv_token", 1e9, False),
}
_TEXT = ("name", "description", "source")
_OPTIONAL = ("max_prefill_tokens",)


@dataclass(frozen=True)
class Profile:
    name: str
    description: str
    source: str
    path: str
    rank: RankConfig

    def as_dict(self) -> dict[str, str]:
        return {"name": self.name, "description": self.description, "source": self.source, "path": self.path}


def profile_names() -> list[str]:
    return sorted(p.name[: -len(SUFFIX)] for p in PROFILE_DIR.glob(f"*{SUFFIX}"))


def load_profile(name: str) -> Profile:
    """A profile shipped with dpboard, by name."""
    path = PROFILE_DIR / f"{name}{SUFFIX}"
    if "/" in name or not path.is_file():
        raise InvalidInputError(
            f"unknown profile {name!r}: use one of {', '.join(profile_names())}, or --profile-file PATH for your own"
        )
    return load_profile_file(path)


def load_profile_file(path: str | Path) -> Profile:
    """Read and check a profile file; errors name the file, the line and the key."""
    p = Path(path)
    if not p.is_file():
        raise NotFoundError(f"profile file {p} does not exist (see dpboard/sim/profiles/ for the format)")
    values: dict[str, str] = {}
    lines: dict[str, int] = {}
    for number, raw in enumerate(p.read_text(encoding="utf-8").splitlines(), start=1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        key, eq, value = line.partition("=")
        key, value = key.strip(), value.strip()
        if not eq or not key:
            raise InvalidInputError(f"profile file {p}, line {number}: {raw.strip()!r} is not 'key = value'")
        if key not in _NUMERIC and key not in _TEXT:
            known = ", ".join([*_TEXT, *_NUMERIC])
            raise InvalidInputError(f"profile file {p}, line {number}: unknown key {key!r} (keys: {known})")
        if key in values:
            raise InvalidInputError(f"profile file {p}, line {number}: {key!r} given twice (first on line {lines[key]})")
        values[key] = value
        lines[key] = number
    missing = [k for k in (*_TEXT, *_NUMERIC) if k not in values and k not in _OPTIONAL]
    if missing:
        raise InvalidInputError(f"profile file {p}: missing {', '.join(missing)}")
    fields: dict[str, int | float] = {}
    for key, (field, unit, whole) in _NUMERIC.items():
        if key not in values:
            continue
        text = values[key]
        try:
            number = float(text)
        except ValueError:
            number = math.nan
        if not math.isfinite(number) or number < 0 or (whole and number != int(number)):
            kind = "a whole number >= 0" if whole else "a number >= 0"
            raise InvalidInputError(f"profile file {p}, line {lines[key]}: {key} = {text!r} is not {kind}")
        fields[field] = int(number) if whole else number / unit
    try:
        rank = RankConfig(**fields).validate()  # type: ignore[arg-type]
    except InvalidInputError as e:
        raise InvalidInputError(f"profile file {p}: {e}") from None
    return Profile(
        name=values["name"], description=values["description"], source=values["source"], path=str(p), rank=rank
    )
