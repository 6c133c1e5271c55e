"""What ``--load`` means: the work a trace offers each rank, as a share of what a rank can do.

A rank's capacity is its throughput at saturation under the rank model (``RankConfig``):

- **prefill** in full steps: a step computes ``prefill_step_tokens`` prompt tokens (the chunked
  prefill size, or ``max_prefill_tokens`` with chunking off) and costs ``prefill_base_s`` plus that
  many times ``prefill_s_per_token``, so one prompt token costs
  ``prefill_s_per_token + prefill_base_s / prefill_step_tokens``;
- **decode** at the largest batch a rank holds for this trace: ``B = min(max_running,
  kv_capacity // s)``, where ``s`` = mean prompt + half the mean output is the KV an average running
  request holds; a decode step of ``B`` such requests takes ``decode_step_s(B, B * s)`` and gives
  ``B`` tokens.

A request's work is its prompt tokens times the prefill cost plus its output tokens but the first
(which comes with the prefill) times the decode cost. The offered load of a trace on ``n`` ranks over
``span`` seconds is the sum of the work over ``n * span``: 1.0 keeps every rank busy all the time
at its best batch. Prefix-cache hits are not subtracted (this is the work offered, before any reuse),
and batches below ``B`` cost more per token, so a run at load 0.9 can saturate.

Under PD disaggregation (``pd_offered_load``) the load is that of the busier pool: the prompts' work
over the prefill ranks, or the outputs' over the decode ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpboard.sim.model import RankConfig


@dataclass(frozen=True)
class TokenCosts:
    """Seconds of rank time per prompt token and per output token at saturation."""

    prefill_s: float
    decode_s: float
    decode_batch: int  # the batch B the decode cost assumes


def token_costs(rank: RankConfig, prompt_len: np.ndarray, output_len: np.ndarray) -> TokenCosts:
    step = rank.prefill_step_tokens
    prefill = rank.prefill_s_per_token + rank.prefill_base_s / step
    if prompt_len.size == 0:
        return TokenCosts(prefill, rank.decode_step_s(1, 0.0), 1)
    held = float(prompt_len.mean()) + float(output_len.mean()) / 2
    batch = max(1, min(rank.max_running, int(rank.kv_capacity // max(held, 1.0))))
    decode = rank.decode_step_s(batch, batch * held) / batch
    return TokenCosts(prefill, decode, batch)


def offered_work_s(rank: RankConfig, prompt_len: np.ndarray, output_len: np.ndarray) -> float:
    """Rank-seconds of work the requests offer, at saturation costs."""
    costs = token_costs(rank, prompt_len, output_len)
    prompt = float(prompt_len.sum())
    decoded = float((output_len - 1).sum())
    return prompt * costs.prefill_s + decoded * costs.decode_s


def offered_load(
    prompt_len: np.ndarray, output_len: np.ndarray, span_s: float, n_ranks: int, rank: RankConfig
) -> float:
    """The requests' work per rank per second of ``span_s``, as a share of one rank's capacity."""
    if span_s <= 0:
        return float("inf") if prompt_len.size else 0.0
    return offered_work_s(rank, prompt_len, output_len) / (n_ranks * span_s)


def pd_offered_load(
    prompt_len: np.ndarray, output_len: np.ndarray, span_s: float, n_prefill: int, n_decode: int, rank: RankConfig
) -> float:
    """PD disaggregation: the busier pool's share of its capacity, the prompts' work over the
    prefill ranks or the outputs' over the decode ranks, at the same saturation costs."""
    if span_s <= 0:
        return float("inf") if prompt_len.size else 0.0
    costs = token_costs(rank, prompt_len, output_len)
    prefill = float(prompt_len.sum()) * costs.prefill_s / (n_prefill * span_s)
    decode = float((output_len - 1).sum()) * costs.decode_s / (n_decode * span_s)
    return max(prefill, decode)
