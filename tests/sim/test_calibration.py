"""The DeepSeek DPA profile against the LMSYS blog's published table, run as the blog ran it.

LMSYS, "Deploying DeepSeek with PD Disaggregation and Large-scale Expert Parallelism on 96 H100
GPUs" (2025-05-05, https://lmsys.org/blog/2025-05-05-large-scale-ep/): prefill 57,674, 54,543 and
50,302 tokens/s per node (8 H100s) at 1K, 2K and 4K prompts with 16,384 tokens per device per
forward; decode 22,282 tokens/s per node at 2K inputs with 256 requests per GPU. The runs are PD in
lockstep (``--pd``, ``--dp-attention``):

- prefill: one node of prefill ranks flooded with prompts of one length; the decode side takes the
  KV and ends each request there (one output token), so nothing holds the prefill back; the
  prompt tokens prefilled per second per node while the flood lasts;
- decode: a node of decode ranks fed 256 requests per rank of 2,000-token prompts by a prefill
  pool large enough to fill them within seconds; output tokens per second per node while every
  decode rank holds 256 running requests. The blog's engine held 256 such requests per GPU, so
  this run gives the ranks the KV that takes (the profile's 500k default holds about 199 with
  SGLang's 512 reserved decode tokens each).

Simulated time only: these figures do not depend on the machine. ``python -m tests.sim.test_calibration``
prints them.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dpboard.sim.pd import simulate_any
from dpboard.sim.profile import load_profile
from dpboard.sim.simulation import RunResult, SimConfig
from dpboard.sim.trace import TraceSpec
from tests.support import traces

BLOG_PREFILL = {1024: 57_674.0, 2048: 54_543.0, 4096: 50_302.0}  # tokens/s per node
BLOG_DECODE = 22_282.0  # tokens/s per node, 2K inputs, 256 requests per GPU
GPUS_PER_NODE = 8
TOLERANCE = 0.15


def _run(n_prefill: int, n_decode: int, prompts: list[int], outputs: list[int], arrivals: list[float],
         kv_capacity: int | None = None) -> RunResult:  # fmt: skip
    profile = load_profile("deepseek-v3-dp-attention-h100")
    rank = profile.rank if kv_capacity is None else dataclasses.replace(profile.rank, kv_capacity=kv_capacity)
    config = SimConfig(
        n_ranks=n_prefill + n_decode, rank=rank, lockstep=profile.lockstep, pd=profile.pd(n_prefill, n_decode)
    )
    trace = traces.hand_trace(arrivals, prompts, outputs, ranks=n_prefill + n_decode, spec=TraceSpec(name="blog"))
    (result,) = simulate_any(trace, ["total_tokens/round_robin"], config)
    return result


def prefill_per_node(prompt: int, requests: int = 2000) -> float:
    """Prompt tokens per second per node of 8 prefill ranks, flooded at t=0 with equal prompts."""
    result = _run(GPUS_PER_NODE, GPUS_PER_NODE, [prompt] * requests, [1] * requests, [0.0] * requests)
    done = np.sort([r.prefilled_s for r in result.requests])
    # between the first and the last prefill step's end: whole steps of every rank
    first, last = done[0], done[-1]
    computed = int(np.sum(done > first)) * prompt
    return computed / (last - first)


def decode_per_node(prompt: int = 2000, output: int = 300, batch: int = 256) -> tuple[float, float]:
    """Output tokens per second per node of 8 decode ranks holding ``batch`` requests each, and the
    mean KV tokens a request held over the measured window."""
    n = batch * GPUS_PER_NODE
    kv = batch * (prompt + output + 512 + 1)
    result = _run(64, GPUS_PER_NODE, [prompt] * n, [output] * n, [0.0] * n, kv_capacity=kv)
    reqs = result.requests
    start = max(r.kv_ready_s for r in reqs)  # every decode rank full from here
    end = min(r.finished_s for r in reqs)  # until the first request ends
    t, decoded = result.sample_t, result.sample_decoded
    assert decoded is not None
    inside = np.flatnonzero((t >= start) & (t <= end))
    assert inside.size >= 2, "the decode pool never held all its requests at once for long"
    a, b = inside[0], inside[-1]
    held = prompt + float(np.mean([(t[a] + t[b]) / 2 - r.kv_ready_s for r in reqs])) * (output - 1) / (
        reqs[0].finished_s - reqs[0].kv_ready_s
    )
    return float(decoded[b] - decoded[a]) / float(t[b] - t[a]), held


@pytest.mark.parametrize("prompt", sorted(BLOG_PREFILL))
def test_pd_prefill_throughput_per_node_within_15_percent_of_the_blog(prompt):
    got = prefill_per_node(prompt)
    assert abs(got / BLOG_PREFILL[prompt] - 1) <= TOLERANCE, (prompt, got)


def test_pd_decode_throughput_per_node_within_15_percent_of_the_blog():
    got, _ = decode_per_node()
    assert abs(got / BLOG_DECODE - 1) <= TOLERANCE, got


if __name__ == "__main__":
    for prompt, blog in sorted(BLOG_PREFILL.items()):
        got = prefill_per_node(prompt)
        print(f"prefill {prompt:>5} tokens: {got:8.0f} tok/s per node, blog {blog:8.0f} ({got / blog - 1:+.1%})")
    got, held = decode_per_node()
    print(
        f"decode 2000-token inputs, 256 per rank: {got:8.0f} tok/s per node (mean KV per request {held:.0f}), "
        f"blog {BLOG_DECODE:8.0f} ({got / BLOG_DECODE - 1:+.1%})"
    )
