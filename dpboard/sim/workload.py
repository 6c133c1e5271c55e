"""What ``--load`` means: the work a trace offers each rank, as a share of what a rank can do.

A rank's capacity is its throughput at saturation under the rank model (``RankConfig``):

- **prefill** in full steps: a step computes ``prefill_step_tokens`` prompt tokens (the chunked
  prefill size, or ``max_prefill_tokens`` with chunking off) and costs ``prefill_base_s`` plus that
  many times ``prefill_s_per_token``, so one prompt token costs
  ``prefill_s_per_token + prefill_base_s / prefill_step_tokens``, plus attention's
  ``prefill_s_per_attention_pair`` times the pairs a prompt's token averages (the sum of the
  prompts' squares over twice their sum; prefix-cache hits not subtracted);
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

**In lockstep** (DP attention, ``lockstep_offered_load``) a rank's capacity is not an independent
rank's: every group step lasts as long as the slowest rank's batch, and one rank's prefill makes it
an extend step for all. At saturation a rank spends a share ``f`` of its steps prefilling full
chunks and the rest decoding batches of ``B``, in the proportion the trace asks for (``f = a / (a +
d)``, with ``a`` = mean prompt / chunk and ``d`` = (mean output - 1) / B steps per request). With
the ranks prefilling independently of each other, ``k`` of the ``n`` prefill in a step with
probability ``Binomial(n, f)``, and the step lasts what ``dpboard.sim.stepping`` says for ``k``
ranks extending a full chunk beside ``n - k`` decoding ``B`` (``k = 0``: a decode step). A request
costs ``E[step] * (prompt / chunk + (output - 1) / B)`` rank-seconds, and the offered load is their
sum over ``ranks * span`` again: the share of the lockstep group's capacity.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from dpboard.sim.model import RankConfig

if TYPE_CHECKING:
    from dpboard.sim.stepping import LockstepCost

# What a load is a share of (the header says which)
RANK_BASIS = "rank"  # an independent rank's capacity (the busier pool's under PD)
LOCKSTEP_BASIS = "lockstep group"  # the lockstep group's capacity under DP attention


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
    if rank.prefill_s_per_attention_pair:
        lengths = prompt_len.astype(np.float64)
        prefill += rank.prefill_s_per_attention_pair * float((lengths**2).sum()) / (2 * max(1.0, float(lengths.sum())))
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


def lockstep_step_s(rank: RankConfig, cost: LockstepCost, n_ranks: int, prefilling: int, batch: int, held: float) -> float:
    """One lockstep step of ``n_ranks``, ``prefilling`` of them computing a full chunk and the others
    decoding ``batch`` requests that hold ``held`` KV tokens each (``dpboard.sim.stepping``'s formula)."""
    chunk = rank.prefill_step_tokens
    decoding = n_ranks - prefilling
    attn_prefill = (rank.prefill_s_per_token - cost.moe_prefill_s_per_token) * chunk
    attn_decode = (rank.decode_s_per_request - cost.moe_decode_s_per_token) * batch + rank.decode_s_per_kv_token * batch * held
    moe = (cost.moe_prefill_s_per_token * chunk * prefilling + cost.moe_decode_s_per_token * batch * decoding) / n_ranks
    if prefilling == 0:
        return rank.decode_base_s + attn_decode + moe
    own = attn_prefill if decoding == 0 else max(attn_prefill, attn_decode + cost.eager_decode_s)
    return rank.prefill_base_s + cost.extend_dispatch_s + own + moe


def lockstep_request_steps(rank: RankConfig, cost: LockstepCost, n_ranks: int, prompt_len: np.ndarray,
                           output_len: np.ndarray) -> tuple[float, float, float]:
    """(mean step seconds at saturation, prefill steps per prompt token, decode steps per output
    token) of a lockstep group of ``n_ranks`` on these requests."""
    chunk = rank.prefill_step_tokens
    if prompt_len.size == 0:
        return lockstep_step_s(rank, cost, n_ranks, 0, 1, 0.0), 1.0 / chunk, 1.0
    held = float(prompt_len.mean()) + float(output_len.mean()) / 2
    batch = max(1, min(rank.max_running, int(rank.kv_capacity // max(held, 1.0))))
    a = float(prompt_len.mean()) / chunk
    d = float((output_len - 1).mean()) / batch
    f = a / (a + d) if a + d > 0 else 0.0
    step = 0.0
    for k in range(n_ranks + 1):
        p = math.comb(n_ranks, k) * f**k * (1.0 - f) ** (n_ranks - k)
        if p > 0.0:
            step += p * lockstep_step_s(rank, cost, n_ranks, k, batch, held)
    return step, 1.0 / chunk, 1.0 / batch


def lockstep_offered_load(
    prompt_len: np.ndarray, output_len: np.ndarray, span_s: float, n_ranks: int, rank: RankConfig, cost: LockstepCost
) -> float:
    """The requests' work as a share of a lockstep group's capacity (the module's docstring)."""
    if span_s <= 0:
        return float("inf") if prompt_len.size else 0.0
    step, per_prompt, per_output = lockstep_request_steps(rank, cost, n_ranks, prompt_len, output_len)
    work = step * (float(prompt_len.sum()) * per_prompt + float((output_len - 1).sum()) * per_output)
    return work / (n_ranks * span_s)


def offered_loads(
    prompt_len: np.ndarray,
    output_len: np.ndarray,
    span_s: float,
    n_ranks: int,
    rank: RankConfig,
    *,
    lockstep: LockstepCost | None = None,
    pd: tuple[int, int] | None = None,
) -> tuple[float, float | None]:
    """(the load ``--load`` scales to, the independent ranks' figure when that is another one): the
    busier pool's under PD, the lockstep group's under DP attention, else an independent rank's."""
    if pd is not None:
        return pd_offered_load(prompt_len, output_len, span_s, pd[0], pd[1], rank), None
    independent = offered_load(prompt_len, output_len, span_s, n_ranks, rank)
    if lockstep is None:
        return independent, None
    return lockstep_offered_load(prompt_len, output_len, span_s, n_ranks, rank, lockstep), independent
