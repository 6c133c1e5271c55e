"""inflight_ttft on a trace no method was tuned on: Markov-modulated arrivals (busy and quiet spells
of random length, not the Poisson streams or fixed bursts of the scenarios, nor a trace file's
times) and a prompt mix of uniform short and uniform long prompts (the scenarios draw log-normal
lengths), with geometric outputs. docs/DISPATCH-RESULTS.md ("Verdict against the bar") reports the
same comparison."""

from __future__ import annotations

import numpy as np

from dpboard.sim.model import RankConfig
from dpboard.sim.report import summarize
from dpboard.sim.simulation import PublishConfig, SimConfig, simulate
from dpboard.sim.trace import Trace

METHODS = [
    "round_robin",
    "total_requests:cadence=sglang",
    "total_tokens:cadence=sglang",
    "vllm",
    "vllm:api_servers=1",
    "cache_aware",
    "dynamo_kv",
    "inflight_requests:cadence=step",
    "inflight_tokens:cadence=step",
    "inflight_backlog:cadence=step",
    "inflight_cache:cadence=step",
    "inflight_ttft:cadence=step",
]


def spells_trace(ranks: int, seed: int, duration: float = 20.0) -> Trace:
    """Busy spells (20 requests/s per rank, 0.6 s on average) between quiet ones (4/s, 1.5 s);
    a quarter of the prompts 2000-6000 tokens, the rest 40-400; outputs geometric, mean 150."""
    rng = np.random.default_rng(seed)
    t, arrivals, busy = 0.0, [], False
    while t < duration:
        span = rng.exponential(0.6 if busy else 1.5)
        n = rng.poisson((20.0 if busy else 4.0) * ranks * span)
        arrivals.extend(t + np.sort(rng.uniform(0.0, span, n)))
        t += span
        busy = not busy
    arrival = np.array([a for a in arrivals if a < duration])
    n = len(arrival)
    long = rng.random(n) < 0.25
    prompts = np.where(long, rng.integers(2000, 6001, n), rng.integers(40, 401, n))
    outputs = rng.geometric(1 / 150, n).clip(1, 2000)
    return Trace(name="spells", n_ranks=ranks, seed=seed, arrival_s=arrival, prompt_len=prompts.astype(np.int64),
                 output_len=outputs.astype(np.int64), is_burst=np.zeros(n, dtype=bool))


def test_inflight_ttft_on_an_unseen_trace():
    trace = spells_trace(8, seed=0)
    config = SimConfig(n_ranks=8, rank=RankConfig(), publish=PublishConfig(cadence="sglang"))
    p99 = {m.split(":")[0] + (":1" if "api_servers" in m else ""): summarize(r)["ttft_p99_ms"]
           for m, r in zip(METHODS, simulate(trace, METHODS, config), strict=True)}
    ttft = p99.pop("inflight_ttft")
    dynamo = p99.pop("dynamo_kv")
    # below the best of SGLang's methods, vLLM (as vllm serve runs it, and one API server), the
    # gateway and dpboard's other methods
    assert ttft < min(p99.values()), (ttft, p99)
    # Dynamo's router still does better here, by about 3 % (docs/DISPATCH-RESULTS.md, "Verdict against
    # the bar"): the bar does not hold against it on this trace
    assert dynamo < ttft, (dynamo, ttft)
