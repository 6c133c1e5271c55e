"""SGLang's ``LoadSnapshot`` to a board slot and back.

A slot holds the dispatch fields (``dpboard.snapshot.LoadSnapshot``) and the detail
(``LoadDetail``: SGLang's other scalars, ``decode_moments`` and the five sections, under SGLang's
names); ``to_sglang(from_sglang(s))`` gives a snapshot whose ``to_dict(include={"all"})`` equals
``s``'s. A slot written without a detail (dpboard's own publishers, a rank relayed from another
node) reads back as ``dpboard.views.loads_document.sglang_load`` describes.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec

from dpboard.snapshot import (
    DETAIL_SECTIONS,
    DisaggregationDetail,
    LoadDetail,
    LoadSnapshot,
    LoraDetail,
    MemoryDetail,
    QueueDetail,
    SpeculativeDetail,
)
from dpboard.views.loads_document import sglang_load

# dpboard's section records and SGLang's struct of each section (load_snapshot.py)
_SECTION_STRUCTS = {
    "memory": (MemoryDetail, "MemoryMetrics"),
    "speculative": (SpeculativeDetail, "SpeculativeMetrics"),
    "lora": (LoraDetail, "LoRAMetrics"),
    "disaggregation": (DisaggregationDetail, "DisaggregationMetrics"),
    "queues": (QueueDetail, "QueueMetrics"),
}
assert set(_SECTION_STRUCTS) == set(DETAIL_SECTIONS)


@functools.cache
def sglang_module() -> Any:
    """``sglang.srt.managers.load_snapshot``, imported on first use (only SGLang's processes get here)."""
    import sglang.srt.managers.load_snapshot as module

    return module


def from_sglang(snap: Any, num_received_reqs: int = 0) -> tuple[LoadSnapshot, LoadDetail]:
    """SGLang's ``LoadSnapshot`` as the slot's dispatch fields and detail."""
    fields = LoadSnapshot(
        int(snap.dp_rank), int(snap.num_running_reqs), int(snap.num_waiting_reqs), int(snap.num_used_tokens),
        int(snap.num_total_tokens), int(snap.num_active_tokens), int(snap.max_total_num_tokens),
        int(num_received_reqs),
    )
    sections = {}
    for name, (record, _) in _SECTION_STRUCTS.items():
        section = getattr(snap, name)
        sections[name] = None if section is None else record(*msgspec.structs.astuple(section))
    moments = snap.decode_moments
    detail = LoadDetail(
        timestamp=snap.timestamp,
        num_waiting_uncached_tokens=snap.num_waiting_uncached_tokens,
        num_prealloc_ready_tokens=snap.num_prealloc_ready_tokens,
        max_running_requests=snap.max_running_requests,
        token_usage=snap.token_usage,
        gen_throughput=snap.gen_throughput,
        cache_hit_rate=snap.cache_hit_rate,
        utilization=snap.utilization,
        total_prefill_uncached_tokens=snap.total_prefill_uncached_tokens,
        total_prefill_busy_us=snap.total_prefill_busy_us,
        decode_moments=None if moments is None else tuple(moments),
        **sections,
    )
    return fields, detail


def to_sglang(load: tuple, detail: tuple) -> Any:
    """One ``DETAILED_DTYPE`` record (its two halves as ``tolist()`` gives them) as SGLang's
    ``LoadSnapshot``."""
    module = sglang_module()
    values = sglang_load(load, detail)
    for name, (_, struct) in _SECTION_STRUCTS.items():
        section = values.get(name)
        if section is not None:
            values[name] = getattr(module, struct)(**section)
    return module.LoadSnapshot(**values)
