"""Traces written by hand for the simulator's tests: every request's arrival, prompt and output
given, optionally its prompt's block ids; and the rank the hand-worked lockstep and PD cases run on."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpboard.sim.model import RankConfig
from dpboard.sim.trace import BlockTable, Trace, TraceSpec

# round figures: a 10 ms prefill base and 100 us a prompt token, a 10 ms decode base and 1 ms a request
HAND_RANK = RankConfig(kv_capacity=100_000, max_running=64, chunked_prefill_size=0, prefill_base_s=0.010,
                       prefill_s_per_token=100e-6, decode_base_s=0.010, decode_s_per_request=1e-3,
                       decode_s_per_kv_token=0.0)


def hand_trace(arrivals: Sequence[float], prompts: Sequence[int], outputs: Sequence[int], *, ranks: int = 1,
               blocks: Sequence[Sequence[int]] | None = None, spec: TraceSpec | None = None) -> Trace:
    table = None
    if blocks is not None:
        offsets = np.cumsum([0] + [len(b) for b in blocks])
        table = BlockTable(offsets=offsets.astype(np.int64),
                           ids=np.asarray([i for b in blocks for i in b], dtype=np.int64))
    return Trace(
        name="hand",
        spec=spec,
        n_ranks=ranks,
        seed=0,
        arrival_s=np.asarray(arrivals, dtype=np.float64),
        prompt_len=np.asarray(prompts, dtype=np.int64),
        output_len=np.asarray(outputs, dtype=np.int64),
        is_burst=np.zeros(len(arrivals), dtype=bool),
        blocks=table,
    )
