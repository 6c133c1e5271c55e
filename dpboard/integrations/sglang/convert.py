"""SGLang's ``LoadSnapshot`` to a board slot and back.

A slot holds the dispatch fields (``dpboard.snapshot.LoadSnapshot``) and the detail
(``DETAIL_DTYPE``: SGLang's other scalars, ``decode_moments`` and the five sections, under SGLang's
names); what ``pack`` writes, ``unpack`` gives back with an equal ``to_dict(include={"all"})``. A slot
written without a detail (dpboard's own publishers) reads back as
``dpboard.views.loads_document.sglang_load`` describes.

Both directions go through one ``struct`` layout derived from ``DETAILED_DTYPE`` (so that it is the
layout of snapshot.py, checked at import), not through NumPy field access: SGLang publishes after
every prefill batch and its DP controller reads every rank up to 50 times a second, and a per-field
NumPy access costs as much as SGLang's whole msgpack encode.
"""

from __future__ import annotations

import functools
import struct
from typing import Any

import msgspec
import numpy as np

from dpboard.snapshot import (
    ALL_SECTIONS,
    DETAIL_DTYPE,
    DETAIL_FLAG,
    DETAIL_PRESENT,
    DETAIL_SECTIONS,
    DETAILED_DTYPE,
    MAX_DECODE_MOMENTS,
    SNAPSHOT_DTYPE,
    moments_count,
)
from dpboard.views.loads_document import sglang_load

# SGLang's struct of each section (load_snapshot.py), in the detail's order
SECTION_STRUCTS = {"memory": "MemoryMetrics", "speculative": "SpeculativeMetrics", "lora": "LoRAMetrics",
                   "disaggregation": "DisaggregationMetrics", "queues": "QueueMetrics"}
assert tuple(SECTION_STRUCTS) == tuple(DETAIL_SECTIONS)


def _struct_format(dtype: np.dtype) -> tuple[str, dict[str, int]]:
    """A ``struct`` format for ``dtype`` (fields in offset order, gaps as padding) and the position
    of each field in the unpacked tuple (nested records flattened, a sub-array its first item)."""
    codes = {("u", 8): "Q", ("i", 8): "q", ("f", 8): "d", ("u", 1): "B"}
    parts: list[str] = []
    positions: dict[str, int] = {}
    count = 0

    def walk(dt: np.dtype, base: int, prefix: str, at: int) -> int:
        nonlocal count
        for name, (field, offset) in sorted(dt.fields.items(), key=lambda item: item[1][1]):
            if base + offset > at:
                parts.append(f"{base + offset - at}x")
                at = base + offset
            if field.names is not None:
                at = walk(field, base + offset, f"{prefix}{name}.", at)
                continue
            positions[prefix + name] = count
            if field.subdtype is not None:
                item, shape = field.subdtype
                n = int(np.prod(shape))
                parts.append(f"{n}{codes[item.kind, item.itemsize]}")
                count += n
            elif field.kind == "S":
                parts.append(f"{field.itemsize}s")
                count += 1
            else:
                parts.append(codes[field.kind, field.itemsize])
                count += 1
            at += field.itemsize
        if at < base + dt.itemsize:
            parts.append(f"{base + dt.itemsize - at}x")
            at = base + dt.itemsize
        return at

    walk(dtype, 0, "", 0)
    return "<" + "".join(parts), positions


_DETAIL_FORMAT, _DETAIL_AT = _struct_format(DETAIL_DTYPE)
DETAIL_STRUCT = struct.Struct(_DETAIL_FORMAT)
_RECORD_FORMAT, _RECORD_AT = _struct_format(DETAILED_DTYPE)
RECORD_STRUCT = struct.Struct(_RECORD_FORMAT)
assert DETAIL_STRUCT.size == DETAIL_DTYPE.itemsize and RECORD_STRUCT.size == DETAILED_DTYPE.itemsize
# pack() below writes the detail's fields in this order: the layout must not move under it
assert DETAIL_DTYPE.names == (
    "flags", "timestamp", "num_waiting_uncached_tokens", "num_prealloc_ready_tokens", "max_running_requests",
    "token_usage", "gen_throughput", "cache_hit_rate", "utilization", "total_prefill_uncached_tokens",
    "total_prefill_busy_us", "decode_moments_count", "decode_moments",
    *(f"{name}_{field}" for name, section in ALL_SECTIONS.items() for field in section._fields),
)

_F_MOMENTS = DETAIL_FLAG["decode_moments"]
_F_SECTION = [DETAIL_FLAG[name] for name in DETAIL_SECTIONS]
_NO_MOMENTS = (0.0,) * MAX_DECODE_MOMENTS
_ZERO_SECTION = {name: (0,) * len(section._fields) for name, section in DETAIL_SECTIONS.items()}
_ZERO_SECTION["disaggregation"] = (b"", *_ZERO_SECTION["disaggregation"][1:])
_MODE_BYTES = DETAIL_DTYPE["disaggregation_mode"].itemsize
_F_LOCKSTEP = DETAIL_FLAG["lockstep"]
_NO_LOCKSTEP = (0,) * len(ALL_SECTIONS["lockstep"]._fields)


@functools.cache
def sglang_module() -> Any:
    """``sglang.srt.managers.load_snapshot``, imported on first use (only SGLang's processes get here)."""
    import sglang.srt.managers.load_snapshot as module

    return module


def dispatch_fields(snap: Any, num_received_reqs: int) -> tuple[int, ...]:
    """The slot's dispatch fields of SGLang's snapshot (the writer stamps the last five)."""
    return (int(snap.dp_rank), int(snap.num_running_reqs), int(snap.num_waiting_reqs), int(snap.num_used_tokens),
            int(snap.num_total_tokens), int(snap.num_active_tokens), int(snap.max_total_num_tokens),
            int(num_received_reqs), 0, 0, 0, 0, 0)


def without_timestamp(snap: Any) -> Any:
    """A copy of SGLang's snapshot with its timestamp zeroed, for comparing two loads; None for a
    snapshot that is not a msgspec Struct (then every write is published)."""
    try:
        return msgspec.structs.replace(snap, timestamp=0.0)
    except TypeError:
        return None


def pack(snap: Any, out: bytearray | memoryview, lockstep: tuple[int, int] | None = None) -> None:
    """SGLang's snapshot's detail into ``out`` (DETAIL_SIZE bytes), as ``BoardWriter.publish`` takes it;
    ``lockstep`` (group size, chunk tokens) is dpboard's own section, what SGLang's snapshot lacks."""
    flags = DETAIL_PRESENT
    if lockstep is None:
        own = _NO_LOCKSTEP
    else:
        own = lockstep
        flags |= _F_LOCKSTEP
    moments = snap.decode_moments
    if moments is None:
        count, values = 0, _NO_MOMENTS
    else:
        count = len(moments)
        if count > MAX_DECODE_MOMENTS:
            raise ValueError(f"decode_moments has {count} values; a slot holds {MAX_DECODE_MOMENTS}")
        values = tuple(float(v) for v in moments) + _NO_MOMENTS[count:]
        flags |= _F_MOMENTS
    sections = []
    for (name, section), flag in zip(DETAIL_SECTIONS.items(), _F_SECTION, strict=True):
        value = getattr(snap, name)
        if value is None:
            sections.append(_ZERO_SECTION[name])
            continue
        flags |= flag
        fields = tuple(getattr(value, field) for field in section._fields)
        if name == "disaggregation":
            mode = fields[0].encode()
            if len(mode) > _MODE_BYTES or b"\x00" in mode:
                raise ValueError(f"disaggregation.mode {fields[0]!r} does not fit the slot's {_MODE_BYTES}-byte text")
            fields = (mode, *fields[1:])
        sections.append(fields)
    memory, speculative, lora, disaggregation, queues = sections
    DETAIL_STRUCT.pack_into(
        out, 0, flags, float(snap.timestamp), int(snap.num_waiting_uncached_tokens),
        int(snap.num_prealloc_ready_tokens), int(snap.max_running_requests), float(snap.token_usage),
        float(snap.gen_throughput), float(snap.cache_hit_rate), float(snap.utilization),
        int(snap.total_prefill_uncached_tokens), int(snap.total_prefill_busy_us), count, *values,
        *memory, *speculative, *lora, *disaggregation, *queues, *own,
    )


class Unpacker:
    """``DETAILED_DTYPE`` records to SGLang ``LoadSnapshot``s."""

    def __init__(self) -> None:
        module = sglang_module()
        self.snapshot = module.LoadSnapshot
        self.sections = [(getattr(module, SECTION_STRUCTS[name]), flag, _RECORD_AT[f"detail.{name}_{section._fields[0]}"],
                          len(section._fields), name == "disaggregation")
                         for (name, section), flag in zip(DETAIL_SECTIONS.items(), _F_SECTION, strict=True)]

    def unpack(self, records: np.ndarray, raw: memoryview, index: int) -> Any:
        """Record ``index`` of ``records`` (``raw``: the same array's bytes) as SGLang's ``LoadSnapshot``."""
        v = RECORD_STRUCT.unpack_from(raw, index * RECORD_STRUCT.size)
        flags = v[_FLAGS]
        if not flags & DETAIL_PRESENT:
            load, detail = records[index].tolist()
            return self.from_dict(sglang_load(load, detail))
        moments = None
        count = moments_count(v[_MOMENTS_COUNT])
        if flags & _F_MOMENTS and count is not None:
            moments = list(v[_MOMENTS : _MOMENTS + count])
        sections = []
        for struct_type, flag, at, n, has_mode in self.sections:
            if not flags & flag:
                sections.append(None)
            elif has_mode:
                sections.append(struct_type(v[at].rstrip(b"\x00").decode(), *v[at + 1 : at + n]))
            else:
                sections.append(struct_type(*v[at : at + n]))
        memory, speculative, lora, disaggregation, queues = sections
        return self.snapshot(
            timestamp=v[_D_TIMESTAMP], dp_rank=v[_L_RANK], num_running_reqs=v[_L_RUNNING],
            num_waiting_reqs=v[_L_WAITING], num_waiting_uncached_tokens=v[_D_UNCACHED], num_used_tokens=v[_L_USED],
            num_total_tokens=v[_L_TOTAL], num_active_tokens=v[_L_ACTIVE], num_prealloc_ready_tokens=v[_D_PREALLOC],
            max_total_num_tokens=v[_L_MAX], max_running_requests=v[_D_MAX_RUNNING], token_usage=v[_D_USAGE],
            gen_throughput=v[_D_THROUGHPUT], cache_hit_rate=v[_D_HIT], utilization=v[_D_UTIL],
            total_prefill_uncached_tokens=v[_D_PREFILL_TOKENS], total_prefill_busy_us=v[_D_PREFILL_US],
            decode_moments=moments, memory=memory, speculative=speculative, lora=lora,
            disaggregation=disaggregation, queues=queues,
        )

    def from_dict(self, values: dict[str, Any]) -> Any:
        module = sglang_module()
        for name, struct_name in SECTION_STRUCTS.items():
            if values.get(name) is not None:
                values[name] = getattr(module, struct_name)(**values[name])
        return self.snapshot(**values)


_L = {name: _RECORD_AT[f"load.{name}"] for name in SNAPSHOT_DTYPE.names}
_L_RANK, _L_RUNNING, _L_WAITING = _L["dp_rank"], _L["num_running_reqs"], _L["num_waiting_reqs"]
_L_USED, _L_TOTAL, _L_ACTIVE, _L_MAX = (_L["num_used_tokens"], _L["num_total_tokens"], _L["num_active_tokens"],
                                        _L["max_total_num_tokens"])
_D = {name: _RECORD_AT[f"detail.{name}"] for name in DETAIL_DTYPE.names}
_FLAGS, _MOMENTS, _MOMENTS_COUNT = _D["flags"], _D["decode_moments"], _D["decode_moments_count"]
_D_TIMESTAMP, _D_UNCACHED, _D_PREALLOC = _D["timestamp"], _D["num_waiting_uncached_tokens"], _D["num_prealloc_ready_tokens"]
_D_MAX_RUNNING, _D_USAGE, _D_THROUGHPUT = _D["max_running_requests"], _D["token_usage"], _D["gen_throughput"]
_D_HIT, _D_UTIL = _D["cache_hit_rate"], _D["utilization"]
_D_PREFILL_TOKENS, _D_PREFILL_US = _D["total_prefill_uncached_tokens"], _D["total_prefill_busy_us"]
