"""Real request traces for ``dpboard sim``: read a file, recognise its format, shape it for a run.

Three formats, recognised from their first line:

- **Azure LLM inference trace** (CSV; Patel et al., "Splitwise", ISCA 2024): header
  ``TIMESTAMP,ContextTokens,GeneratedTokens``; ``TIMESTAMP`` is an absolute time such as
  ``2023-11-16 18:15:46.6805900``.
- **Mooncake** (JSON lines; Qin et al., FAST 2025): one object per line with ``timestamp``
  (milliseconds from 0), ``input_length``, ``output_length`` and ``hash_ids``, one id per 512-token
  prompt block, chained (equal ids are equal prefixes). Its timestamps come in buckets of about 3 s;
  ``shape_trace`` spreads each bucket's requests uniformly over the bucket (seeded), unless told not to.
- **BurstGPT** (CSV; Wang et al., 2024): header ``Timestamp,Model,Request tokens,Response tokens,
  Total tokens,Log Type``; ``Timestamp`` in seconds from the start.

The whole file is read and checked before anything runs: a header that is none of these, or a row
with a bad value, is an ``InvalidInputError`` naming the file, the line and the column. A request
whose output is 0 tokens (BurstGPT's failed requests) runs with 1, the first token, and is counted.

``shape_trace`` then takes a window of the file's time, and scales the arrival times (never the
lengths) so that the offered work per rank is a chosen share of a rank's capacity
(``dpboard.sim.workload``).
"""

from __future__ import annotations

import csv
import datetime as dt
import json
import math
import re
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from dpboard.errors import InvalidInputError, NotFoundError
from dpboard.sim.model import RankConfig
from dpboard.sim.prefix_cache import BLOCK_TOKENS
from dpboard.sim.stepping import LockstepCost
from dpboard.sim.trace import BlockTable, Trace
from dpboard.sim.workload import LOCKSTEP_BASIS, RANK_BASIS, offered_loads

AZURE = "azure"
MOONCAKE = "mooncake"
BURSTGPT = "burstgpt"

FORMAT_LABELS = {
    AZURE: "Azure LLM inference trace (CSV)",
    MOONCAKE: "Mooncake trace (JSON lines, with prefix block ids)",
    BURSTGPT: "BurstGPT trace (CSV)",
}

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
BURSTGPT_COLUMNS = ("Timestamp", "Model", "Request tokens", "Response tokens", "Total tokens", "Log Type")
MOONCAKE_KEYS = ("timestamp", "input_length", "output_length")

_KNOWN = (
    f"Azure CSV ({','.join(AZURE_COLUMNS)}), BurstGPT CSV ({','.join(BURSTGPT_COLUMNS)}) or "
    f"Mooncake JSON lines ({', '.join(MOONCAKE_KEYS)}, hash_ids)"
)
_UINT = re.compile(r"\d+")
# A request's prompt or output beyond this is no real request: the bound keeps every sum of token
# counts (a KV-fit check adds prompt and output) far from int64's end.
MAX_TOKENS = 2**32
MAX_BLOCK_ID = 2**63 - 1  # block ids are kept as int64
_AZURE_TIME = re.compile(r"(\d{4})-(\d{2})-(\d{2})[ T](\d{2}):(\d{2}):(\d{2})(?:\.(\d{1,9}))?")


@dataclass
class TraceFile:
    """What a trace file holds, as written (times in seconds from its first request, sorted)."""

    path: str
    format: str
    arrival_s: np.ndarray  # float64
    prompt_len: np.ndarray  # int64, >= 1
    output_len: np.ndarray  # int64, >= 1 (0 in the file runs as 1)
    blocks: BlockTable | None
    zero_output: np.ndarray  # bool: the file said 0 output tokens (run as 1)
    bucketed: bool  # times come in coarse buckets (Mooncake): spread them before replay

    @property
    def label(self) -> str:
        return FORMAT_LABELS[self.format]

    def __len__(self) -> int:
        return int(self.arrival_s.size)


class _Where:
    """Names the file, line and column of a bad value."""

    def __init__(self, path: str):
        self.path = path

    def error(self, line: int, column: int | str, name: str | None, problem: str) -> InvalidInputError:
        col = f"column {column}" if isinstance(column, int) else f"column {column!r}"
        named = f" ({name})" if name and isinstance(column, int) else ""
        return InvalidInputError(f"trace file {self.path}, line {line}, {col}{named}: {problem}")


def read_trace_file(path: str | Path) -> TraceFile:
    """Read and check a whole trace file; its format comes from its first line. The file is read
    line by line into arrays of 8 bytes a value: memory stays near twice the file's size."""
    name = str(path)
    p = Path(path)
    if not p.exists():
        raise NotFoundError(f"trace file {name} does not exist: give the path of an Azure, BurstGPT or Mooncake trace")
    if p.is_dir():
        raise InvalidInputError(f"trace file {name} is a directory: give the path of a trace file")
    where = _Where(name)
    try:
        with open(p, encoding="utf-8-sig", newline="") as f:
            first = ""
            for first in f:
                if first.strip():
                    break
            if not first.strip():
                raise InvalidInputError(f"trace file {name} is empty: expected {_KNOWN}")
            f.seek(0)
            if first.lstrip().startswith("{"):
                return _read_mooncake(f, where)
            header = [h.strip() for h in next(csv.reader([first]))]
            if all(c in header for c in AZURE_COLUMNS):
                return _read_azure(f, header, where)
            if all(c in header for c in ("Timestamp", "Request tokens", "Response tokens")):
                return _read_burstgpt(f, header, where)
    except UnicodeDecodeError as e:
        raise InvalidInputError(f"trace file {name} is not UTF-8 text ({e}): is it compressed? unpack it first") from None
    except csv.Error as e:  # the header line itself
        raise InvalidInputError(f"trace file {name}, line 1: {e}") from None
    raise InvalidInputError(
        f"trace file {name}, line 1: header {','.join(header)!r} is not a trace format dpboard reads: "
        f"expected {_KNOWN}"
    )


# -- CSV ---------------------------------------------------------------------------------------


def _csv_rows(f: TextIO, header: list[str], where: _Where) -> Iterator[tuple[int, list[str]]]:
    """(line number, fields) of each non-empty data row, with exactly as many fields as the header."""
    reader = csv.reader(f)
    seen_header = False
    while True:
        try:
            fields = next(reader)
        except StopIteration:
            return
        except csv.Error as e:  # a field over csv's limit (128 KiB), a NUL byte...
            line = reader.line_num
            raise where.error(line, _long_field(f, line), None, f"not a CSV row this reader takes ({e})") from None
        line = reader.line_num
        if not fields or all(not f.strip() for f in fields):
            continue
        if not seen_header:
            seen_header = True
            continue
        if len(fields) < len(header):
            missing = len(fields)
            raise where.error(line, missing + 1, header[missing], "missing (the row is short)")
        if len(fields) > len(header):
            raise where.error(line, len(header) + 1, None, f"unexpected extra value {fields[len(header)]!r}")
        yield line, fields


def _long_field(f: TextIO, line: int) -> int:
    """The column of the first field of ``line`` longer than csv's field limit (1 when none is)."""
    f.seek(0)
    for number, text in enumerate(f, start=1):
        if number == line:
            limit = csv.field_size_limit()
            return next((k + 1 for k, field in enumerate(text.split(",")) if len(field) > limit), 1)
    return 1


def _uint(text: str, where: _Where, line: int, col: int, name: str, minimum: int) -> int:
    s = text.strip()
    if not _UINT.fullmatch(s):
        raise where.error(line, col, name, f"{_short(text)!r} is not a whole number of tokens")
    if len(s.lstrip("0")) > len(str(MAX_TOKENS)):  # before int(): it refuses past 4,300 digits
        raise where.error(line, col, name, f"{_short(s)} tokens: more than the {MAX_TOKENS} a request may have")
    value = int(s)
    _check_tokens(value, minimum, where, line, col, name)
    return value


def _check_tokens(value: int, minimum: int, where: _Where, line: int, col: int | str, name: str | None) -> None:
    if value < minimum:
        raise where.error(line, col, name, f"{value} tokens: must be >= {minimum}")
    if value > MAX_TOKENS:
        raise where.error(line, col, name, f"{value} tokens: more than the {MAX_TOKENS} a request may have")


def _short(text: str) -> str:
    """A value as an error message shows it: at most 40 characters."""
    return text if len(text) <= 40 else f"{text[:20]}...{text[-10:]} ({len(text)} characters)"


def _azure_seconds(text: str, where: _Where, line: int, col: int) -> tuple[int, float]:
    m = _AZURE_TIME.fullmatch(text.strip())
    if m is None:
        raise where.error(line, col, "TIMESTAMP", f"{text!r} is not a time like 2023-11-16 18:15:46.6805900")
    year, month, day, hour, minute, second, frac = m.groups()
    try:
        day_number = dt.date(int(year), int(month), int(day)).toordinal()
        moment = dt.time(int(hour), int(minute), int(second))
    except ValueError as e:
        raise where.error(line, col, "TIMESTAMP", f"{text!r}: {e}") from None
    whole = day_number * 86400 + moment.hour * 3600 + moment.minute * 60 + moment.second
    return whole, float("0." + frac) if frac else 0.0


def _append_lengths(fields: list[str], where: _Where, line: int, prompt: tuple[array, int, str],
                    output: tuple[array, int, str]) -> None:
    """A CSV row's prompt tokens (at least 1) and output tokens, each (the array it goes to, its
    column, its name) checked, onto their arrays."""
    for (values, col, name), least in ((prompt, 1), (output, 0)):
        values.append(_uint(fields[col], where, line, col + 1, name, least))


def _require_rows(rows: array, where: _Where) -> None:
    if not rows:
        raise InvalidInputError(f"trace file {where.path} has a header but no requests")


def _read_azure(f: TextIO, header: list[str], where: _Where) -> TraceFile:
    ti, ci, gi = (header.index(c) for c in AZURE_COLUMNS)
    whole = array("q")
    frac = array("d")
    prompt = array("q")
    output = array("q")
    for line, fields in _csv_rows(f, header, where):
        w, f = _azure_seconds(fields[ti], where, line, ti + 1)
        whole.append(w)
        frac.append(f)
        _append_lengths(fields, where, line, (prompt, ci, "ContextTokens"), (output, gi, "GeneratedTokens"))
    _require_rows(whole, where)
    # Whole seconds as integers first: absolute times near 2**31 s would lose the sub-ms part in a float.
    seconds = np.frombuffer(whole, dtype=np.int64)
    arrival = (seconds - seconds.min()).astype(np.float64) + np.frombuffer(frac, dtype=np.float64)
    return _finish(where.path, AZURE, arrival - arrival.min(), prompt, output, None, bucketed=False)


def _read_burstgpt(f: TextIO, header: list[str], where: _Where) -> TraceFile:
    ti = header.index("Timestamp")
    ri = header.index("Request tokens")
    oi = header.index("Response tokens")
    arrival = array("d")
    prompt = array("q")
    output = array("q")
    for line, fields in _csv_rows(f, header, where):
        raw = fields[ti].strip()
        try:
            t = float(raw)
        except ValueError:
            t = math.nan
        if not math.isfinite(t) or t < 0:
            raise where.error(line, ti + 1, "Timestamp", f"{_short(fields[ti])!r} is not a time in seconds >= 0")
        arrival.append(t)
        _append_lengths(fields, where, line, (prompt, ri, "Request tokens"), (output, oi, "Response tokens"))
    _require_rows(arrival, where)
    times = np.frombuffer(arrival, dtype=np.float64)
    return _finish(where.path, BURSTGPT, times - times.min(), prompt, output, None, bucketed=False)


# -- JSON lines --------------------------------------------------------------------------------


def _json_uint(obj: dict, key: str, where: _Where, line: int, minimum: int) -> int:
    if key not in obj:
        raise where.error(line, key, None, "missing")
    value = obj[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise where.error(line, key, None, f"{_short(repr(value))} is not a whole number of tokens")
    _check_tokens(value, minimum, where, line, key, None)
    return value


def _read_mooncake(f: TextIO, where: _Where) -> TraceFile:
    times = array("d")
    prompt = array("q")
    output = array("q")
    offsets = array("q", [0])
    ids = array("q")
    with_ids: bool | None = None
    for line, raw in enumerate(f, start=1):
        raw = raw.rstrip("\r\n")
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as e:
            raise where.error(line, e.colno, None, f"not valid JSON ({e.msg})") from None
        except ValueError as e:  # an integer of more than 4,300 digits
            raise where.error(line, 1, None, f"not a JSON value this reader takes ({e})") from None
        except RecursionError:
            raise where.error(line, 1, None, "JSON nested too deeply") from None
        if not isinstance(obj, dict):
            raise where.error(line, 1, None, f"expected a JSON object with {', '.join(MOONCAKE_KEYS)}")
        if with_ids is None and not all(k in obj for k in MOONCAKE_KEYS):
            raise InvalidInputError(
                f"trace file {where.path}, line {line}: a JSON object without the Mooncake keys "
                f"{', '.join(MOONCAKE_KEYS)} (it has {', '.join(obj) or 'none'}): expected {_KNOWN}"
            )
        if "timestamp" not in obj:
            raise where.error(line, "timestamp", None, "missing")
        t = obj["timestamp"]
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise where.error(line, "timestamp", None, f"{t!r} is not a time in milliseconds >= 0")
        length = _json_uint(obj, "input_length", where, line, 1)
        out = _json_uint(obj, "output_length", where, line, 0)
        has = "hash_ids" in obj
        if with_ids is None:
            with_ids = has
        elif has != with_ids:
            first = "has" if with_ids else "has no"
            raise where.error(line, "hash_ids", None, f"{'missing' if with_ids else 'unexpected'}: the first line {first} hash_ids, so every line must match")
        if has:
            row = obj["hash_ids"]
            want = -(-length // BLOCK_TOKENS)
            if not isinstance(row, list) or not all(
                    isinstance(h, int) and not isinstance(h, bool) and 0 <= h <= MAX_BLOCK_ID for h in row):
                raise where.error(line, "hash_ids", None,
                                  f"expected a list of block ids (whole numbers in [0, {MAX_BLOCK_ID}])")
            if len(row) != want:
                raise where.error(
                    line,
                    "hash_ids",
                    None,
                    f"{len(row)} ids for {length} prompt tokens: one id per {BLOCK_TOKENS}-token block needs {want}",
                )
            ids.extend(row)
            offsets.append(len(ids))
        times.append(t / 1000.0)
        prompt.append(length)
        output.append(out)
    if not times:
        raise InvalidInputError(f"trace file {where.path} has no requests")
    blocks = None
    if with_ids:
        blocks = BlockTable(offsets=np.frombuffer(offsets, dtype=np.int64), ids=np.frombuffer(ids, dtype=np.int64))
    arrival = np.frombuffer(times, dtype=np.float64)
    return _finish(where.path, MOONCAKE, arrival - arrival.min(), prompt, output, blocks, bucketed=True)


def _finish(
    path: str,
    fmt: str,
    arrival: np.ndarray,
    prompt: array,
    output: array,
    blocks: BlockTable | None,
    *,
    bucketed: bool,
) -> TraceFile:
    out = np.frombuffer(output, dtype=np.int64)
    order = np.argsort(arrival, kind="stable")
    sorted_already = bool(np.all(order == np.arange(order.size)))
    return TraceFile(
        path=path,
        format=fmt,
        arrival_s=arrival if sorted_already else arrival[order],
        prompt_len=np.frombuffer(prompt, dtype=np.int64)[order],
        output_len=np.maximum(out, 1)[order],
        blocks=None if blocks is None else (blocks if sorted_already else blocks.take(order)),
        zero_output=(out == 0)[order],
        bucketed=bucketed,
    )


# -- shaping for a run -------------------------------------------------------------------------


def parse_window(text: str) -> tuple[float | None, float | None]:
    """``"START:END"`` in seconds, either side may be empty: ``"600:1200"``, ``":300"``, ``"1800:"``."""
    start_s, sep, end_s = text.partition(":")
    if not sep:
        raise InvalidInputError(f"--window {text!r}: write START:END in seconds, e.g. 600:1200 (either side may be empty)")
    bounds: list[float | None] = []
    for part in (start_s, end_s):
        part = part.strip()
        if not part:
            bounds.append(None)
            continue
        try:
            value = float(part)
        except ValueError:
            raise InvalidInputError(f"--window {text!r}: {part!r} is not a number of seconds") from None
        if not math.isfinite(value) or value < 0:
            raise InvalidInputError(f"--window {text!r}: {part!r} must be a number of seconds >= 0")
        bounds.append(value)
    start, end = bounds
    if start is not None and end is not None and end <= start:
        raise InvalidInputError(f"--window {text!r}: END must be after START")
    return start, end


def spread_buckets(arrival_s: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Spread the requests of each distinct timestamp uniformly up to the next one (the last bucket
    gets the median width), so that a bucketed trace does not arrive in lumps."""
    stamps, index = np.unique(arrival_s, return_inverse=True)
    if stamps.size < 2:
        return arrival_s.copy()
    widths = np.diff(stamps)
    widths = np.append(widths, np.median(widths))
    return stamps[index] + rng.uniform(0.0, 1.0, size=arrival_s.size) * widths[index]


def shape_trace(
    tf: TraceFile,
    *,
    n_ranks: int,
    seed: int,
    rank: RankConfig,
    window: tuple[float | None, float | None] = (None, None),
    spread: bool = True,
    load: float | None = None,
    pd: tuple[int, int] | None = None,
    lockstep: LockstepCost | None = None,
) -> Trace:
    """The run's trace from a file: spread (bucketed formats), window, then time-scaled to ``load``.

    ``load`` is the offered work per rank as a share of a rank's capacity (``dpboard.sim.workload``),
    with ``pd`` (prefill, decode ranks) that of the busier pool, with ``lockstep`` (DP attention)
    that of the lockstep group; None keeps the file's own timing."""
    if n_ranks < 1:
        raise InvalidInputError(f"a trace needs at least one rank, got n_ranks={n_ranks}")
    if load is not None and not (math.isfinite(load) and load > 0):
        raise InvalidInputError(f"--load must be > 0 (a share of the ranks' capacity, e.g. 0.8), got {load}")
    arrival = tf.arrival_s
    spread_done = False
    if spread and tf.bucketed:
        arrival = spread_buckets(arrival, np.random.default_rng(seed))
        spread_done = True
    start, end = window
    lo = 0.0 if start is None else start
    keep = arrival >= lo
    if end is not None:
        keep &= arrival < end
    index = np.flatnonzero(keep)
    if index.size == 0:
        raise InvalidInputError(
            f"--window {lo:g}:{'' if end is None else f'{end:g}'} holds no request of {tf.path} "
            f"(its requests span 0 to {float(tf.arrival_s.max()):.1f} s)"
        )
    order = index[np.argsort(arrival[index], kind="stable")]
    times = arrival[order] - lo
    prompt = tf.prompt_len[order]
    output = tf.output_len[order]
    blocks = tf.blocks.take(order) if tf.blocks is not None else None
    # The span the requests were offered over: the window when it is closed, else up to the last one.
    span = (end - lo) if end is not None else float(times[-1])
    natural, independent = offered_loads(prompt, output, span, n_ranks, rank, lockstep=lockstep, pd=pd)
    scale = 1.0
    if load is not None:
        if not math.isfinite(natural) or natural <= 0:
            raise InvalidInputError(
                f"cannot scale {tf.path} to --load {load}: its requests span no time (give a --window with an END)"
            )
        scale = natural / load
        times = times * scale
    info = {
        "path": tf.path,
        "format": tf.format,
        "format_label": tf.label,
        "file_requests": len(tf),
        "zero_outputs_run_as_1": int(tf.zero_output[order].sum()),
        "window_s": [lo, end],
        "spread": spread_done,
        "span_s": span,
        "natural_load": natural,
        "time_scale": scale,
        "load": natural / scale,
        "load_basis": LOCKSTEP_BASIS if independent is not None else RANK_BASIS,
        "independent_load": None if independent is None else independent / scale,
    }
    return Trace(
        name=Path(tf.path).name,
        n_ranks=n_ranks,
        seed=seed,
        arrival_s=times,
        prompt_len=prompt,
        output_len=output,
        is_burst=np.zeros(times.size, dtype=bool),
        blocks=blocks,
        info=info,
    )
