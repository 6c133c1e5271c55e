"""``GET /v1/loads``: a board as SGLang 0.5.23's loads endpoint shows its ranks, key for key.

SGLang's document is ``{timestamp, version, accelerator, num_accelerators, loads}``, one object per
published rank, each what ``LoadSnapshot.to_dict(include)`` gives: the 18 core keys always, then the
sections the rank carries that ``include`` asks for. A slot maps onto those keys as follows:

- with a detail (a board written by the SGLang plugin): every key from the slot, as SGLang wrote it;
- without one (dpboard's own publishers, or a rank relayed from another node): the core keys from
  the dispatch fields, ``timestamp`` from the write time, ``token_usage`` derived, the detail-only
  scalars 0, ``decode_moments`` null and no section.

``disaggregation.mode`` is the one text field: bytes of it that are not UTF-8 show as U+FFFD (the
replacement character), and the rank is listed as any other.

Only LIVE ranks are listed. SGLang leaves out a rank that never published; a STALE, TORN or EMPTY
slot is left out the same way, so that a client that knows only SGLang's keys never takes a dead
rank for an idle one. What dpboard knows beyond SGLang is added under keys SGLang does not use:
per rank ``status``, ``age_s``, ``publish_seq``, ``node_id``, ``writer_pid``, ``num_received_reqs``,
``timestamp_ns``; at the top ``board``, ``generation``, ``imbalance`` and ``omitted_ranks`` (the
ranks left out, with their status).

``?format=prometheus`` is SGLang's text: ``# TYPE sglang_<key> gauge`` and one
``sglang_<key>{dp_rank="N"} value`` line per rank, sections under ``sglang_<prefix>_<key>``.
"""

from __future__ import annotations

import time
from datetime import datetime, timezone
from typing import Any

import numpy as np

from dpboard.snapshot import (
    DETAIL_DTYPE,
    DETAIL_FLAG,
    DETAIL_PRESENT,
    DETAIL_SECTIONS,
    SNAPSHOT_DTYPE,
    SlotStatus,
    moments_count,
    token_usage,
)
from dpboard.views.watch import imbalance

# LoadSnapshot.to_dict's keys, in SGLang's order: the core keys (every field but the sections) ...
CORE_KEYS: tuple[str, ...] = (
    "timestamp", "dp_rank", "num_running_reqs", "num_waiting_reqs", "num_waiting_uncached_tokens",
    "num_used_tokens", "num_total_tokens", "num_active_tokens", "num_prealloc_ready_tokens",
    "max_total_num_tokens", "max_running_requests", "token_usage", "gen_throughput", "cache_hit_rate",
    "utilization", "total_prefill_uncached_tokens", "total_prefill_busy_us", "decode_moments",
)
# ... and the sections: (key in the document, name in ?include=, prefix of its Prometheus gauges)
SECTIONS: tuple[tuple[str, str, str], ...] = (
    ("memory", "memory", "memory"),
    ("speculative", "spec", "spec"),
    ("lora", "lora", "lora"),
    ("disaggregation", "disagg", "disagg"),
    ("queues", "queues", "queues"),
)
VALID_INCLUDE = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})
PROMETHEUS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DISPATCH_KEYS = ("dp_rank", "num_running_reqs", "num_waiting_reqs", "num_used_tokens", "num_total_tokens",
                 "num_active_tokens", "max_total_num_tokens")

assert set(DETAIL_SECTIONS) == {key for key, _, _ in SECTIONS}

_L = {name: i for i, name in enumerate(SNAPSHOT_DTYPE.names)}
_D = {name: i for i, name in enumerate(DETAIL_DTYPE.names)}
_LIVE = int(SlotStatus.LIVE)


class IncludeError(ValueError):
    """An ``include`` SGLang refuses; the message is SGLang's."""


def parse_include(raw: str | None) -> set[str] | None:
    """``?include=`` as SGLang reads it: comma-separated, stripped; empty or absent means every section.

    Checked as ``LoadSnapshot.to_dict`` checks it: anything goes beside ``all``; otherwise every
    name must be one of VALID_INCLUDE."""
    names = [s.strip() for s in raw.split(",")] if raw else None
    include = set(names) if names else None
    if include is not None and "all" not in include and not include <= VALID_INCLUDE:
        raise IncludeError(f"Invalid include sections: {include - VALID_INCLUDE}. "
                           f"Valid options: {sorted(VALID_INCLUDE)}")
    return include


def sglang_load(load: tuple, detail: tuple) -> dict[str, Any]:
    """One slot as SGLang's ``LoadSnapshot.to_dict()`` shows it (every section it carries).

    ``load`` and ``detail`` are the two halves of a ``DETAILED_DTYPE`` record as ``tolist()`` gives
    them. A slot without a detail gets the core keys from its dispatch fields (docstring above)."""
    flags = detail[_D["flags"]]
    if not flags & DETAIL_PRESENT:
        used, capacity = load[_L["num_used_tokens"]], load[_L["max_total_num_tokens"]]
        out: dict[str, Any] = dict.fromkeys(CORE_KEYS, 0)
        out.update({key: load[_L[key]] for key in DISPATCH_KEYS})
        out.update(timestamp=load[_L["timestamp_ns"]] / 1e9, token_usage=token_usage(used, capacity),
                   gen_throughput=0.0, cache_hit_rate=0.0, utilization=0.0, decode_moments=None)
        return out
    out = {}
    for key in CORE_KEYS:
        if key == "decode_moments":
            count = moments_count(detail[_D["decode_moments_count"]])
            moments = detail[_D["decode_moments"]]
            out[key] = [float(v) for v in moments[:count]] if flags & DETAIL_FLAG[key] and count is not None else None
        elif key in _D:
            out[key] = detail[_D[key]]
        else:
            out[key] = load[_L[key]]
    for key, _, _ in SECTIONS:
        if flags & DETAIL_FLAG[key]:
            section = {field: detail[_D[f"{key}_{field}"]] for field in DETAIL_SECTIONS[key]._fields}
            if key == "disaggregation":
                # a writer's raw bytes: one slot that is not UTF-8 must not take the document down
                # for every rank, so what does not decode shows as U+FFFD
                section["mode"] = section["mode"].decode(errors="replace")
            out[key] = section
    return out


def select(load: dict[str, Any], include: set[str] | None) -> dict[str, Any]:
    """``load`` cut down as ``LoadSnapshot.to_dict(include)`` cuts (core keys always kept)."""
    if include is None or "all" in include:
        return load
    out = {key: load[key] for key in CORE_KEYS}
    if include == {"core"}:
        return out
    for key, name, _ in SECTIONS:
        if name in include and key in load:
            out[key] = load[key]
    return out


def rank_loads(records: np.ndarray, *, now_ns: int | None = None) -> tuple[list[dict[str, Any]], list[dict]]:
    """(SGLang-shaped loads of the LIVE ranks with dpboard's extra keys, the ranks left out) of
    ``read_detailed_array()`` records."""
    now = time.monotonic_ns() if now_ns is None else now_ns
    loads, omitted = [], []
    for load, detail in records.tolist():
        status = load[_L["status"]]
        rank = load[_L["dp_rank"]]
        has_data = SlotStatus(status).has_snapshot
        age = (now - load[_L["monotonic_ns"]]) / 1e9 if has_data else None
        if status != _LIVE:
            omitted.append({"dp_rank": rank, "status": SlotStatus(status).label, "age_s": age})
            continue
        entry = sglang_load(load, detail)
        entry.update(status=SlotStatus.LIVE.label, age_s=age, publish_seq=load[_L["publish_seq"]],
                     node_id=load[_L["node_id"]], writer_pid=load[_L["writer_pid"]],
                     num_received_reqs=load[_L["num_received_reqs"]], timestamp_ns=load[_L["timestamp_ns"]])
        loads.append(entry)
    return loads, omitted


def _sglang_keys_only(load: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in load.items() if key in CORE_KEYS or key in DETAIL_SECTIONS}


def loads_document(
    records: np.ndarray,
    *,
    board: str,
    generation: int,
    version: str,
    include: set[str] | None = None,
    dp_rank: int | None = None,
    accelerator: str | None = None,
    num_accelerators: int = 1,
) -> dict[str, Any]:
    """The JSON document of ``/v1/loads`` (see the module docstring)."""
    loads, omitted = rank_loads(records)
    # over every live rank, also when one is asked for: over that one alone it would always be 1
    board_imbalance = imbalance([load["num_total_tokens"] for load in loads])
    if dp_rank is not None:
        loads = [load for load in loads if load["dp_rank"] == dp_rank]
        omitted = [o for o in omitted if o["dp_rank"] == dp_rank]
    extras = ("status", "age_s", "publish_seq", "node_id", "writer_pid", "num_received_reqs", "timestamp_ns")
    shown = [{**select(_sglang_keys_only(load), include), **{k: load[k] for k in extras}} for load in loads]
    return {
        "timestamp": datetime.now(timezone.utc).isoformat(),
        "version": version,
        "accelerator": accelerator,
        "num_accelerators": num_accelerators,
        "loads": shown,
        "board": board,
        "generation": generation,
        "imbalance": board_imbalance,
        "omitted_ranks": omitted,
    }


def prometheus_loads(records: np.ndarray, *, include: set[str] | None = None, dp_rank: int | None = None) -> bytes:
    """``/v1/loads?format=prometheus``: SGLang's text for the LIVE ranks (PROMETHEUS_CONTENT_TYPE).

    Numbers only, as SGLang: ``decode_moments`` (a list), ``disaggregation.mode`` (text) and null
    values have no gauge; ``dp_rank`` is the label. Gauges appear in the order first met."""
    loads, _ = rank_loads(records)
    samples: dict[str, list[tuple[int, int | float]]] = {}
    prefixes = {key: prefix for key, _, prefix in SECTIONS}
    for load in loads:
        if dp_rank is not None and load["dp_rank"] != dp_rank:
            continue
        shown = select(_sglang_keys_only(load), include)
        rank = shown.pop("dp_rank")
        for key, value in shown.items():
            if isinstance(value, dict):
                for sub, sub_value in value.items():
                    if isinstance(sub_value, (int, float)):
                        samples.setdefault(f"sglang_{prefixes[key]}_{sub}", []).append((rank, sub_value))
            elif isinstance(value, (int, float)):
                samples.setdefault(f"sglang_{key}", []).append((rank, value))
    lines = []
    for name, values in samples.items():
        lines.append(f"# TYPE {name} gauge")
        lines.extend(f'{name}{{dp_rank="{rank}"}} {value}' for rank, value in values)
    return ("\n".join(lines) + "\n").encode()
