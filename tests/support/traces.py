"""Traces written by hand for the simulator's tests: every request's arrival, prompt and output
given, optionally its prompt's block ids."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from dpboard.sim.trace import BlockTable, Trace, TraceSpec


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
