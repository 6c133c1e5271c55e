"""Request traces for ``dpboard sim``: when requests arrive, how long they are, what prefix they share.

A ``Trace`` holds arrays of arrival times, prompt and output lengths and, where the source has them,
the prompt's block ids (one per 512 tokens, chained: equal ids are equal prefixes). Traces come from
a file (``dpboard.sim.tracefile``) or from one of the named synthetic scenarios below.

A synthetic trace is a deterministic function of its ``TraceSpec``, the number of ranks and a seed (a NumPy
``Generator``; no wall clock, no global random state), so two runs with the same arguments see the
same requests in the same order. Rates and burst sizes are given per rank and scaled by the number
of ranks, so that ``--ranks 4`` and ``--ranks 16`` put the same load on each rank.

Three named scenarios cover what a dispatcher must handle:

- ``steady``: Poisson arrivals, one prompt-length population.
- ``bursty``: a lighter Poisson background plus bursts of hundreds of requests within a few ms.
- ``longshort``: Poisson arrivals where a small share of prompts are ten to a hundred times longer.

Output lengths are log-normal with a wide spread (a heavy right tail): most answers are short, a
few run for thousands of tokens and hold their rank's KV cache and batch slot for a long time.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpboard.errors import InvalidInputError


@dataclass(frozen=True)
class TraceSpec:
    """How to draw a trace. Rates and burst sizes are per rank."""

    name: str
    duration_s: float = 30.0
    rate_per_rank: float = 4.0  # background Poisson arrivals, requests per second per rank
    burst_every_s: float = 0.0  # mean gap between bursts (exponential); 0 = no bursts
    burst_per_rank: float = 0.0  # requests per burst per rank (the burst size is this times ranks)
    burst_span_s: float = 0.005  # a burst's requests arrive uniformly within this span
    short_prompt_median: float = 600.0
    short_prompt_sigma: float = 0.6  # log-normal sigma of prompt lengths
    long_fraction: float = 0.0  # share of requests drawn from the long population
    long_prompt_median: float = 12000.0
    long_prompt_sigma: float = 0.4
    prompt_min: int = 16
    prompt_max: int = 32768
    output_median: float = 120.0
    output_sigma: float = 1.1  # wide: heavy right tail of output lengths
    output_max: int = 4096

    def scaled(self, *, load: float = 1.0, duration_s: float | None = None) -> TraceSpec:
        """The same scenario with every arrival rate (and burst size) multiplied by ``load``."""
        if load <= 0:
            raise InvalidInputError(f"trace load must be > 0 (a multiplier of the arrival rates), got {load}")
        return dataclasses.replace(
            self,
            rate_per_rank=self.rate_per_rank * load,
            burst_per_rank=self.burst_per_rank * load,
            duration_s=self.duration_s if duration_s is None else duration_s,
        )


SCENARIOS: dict[str, TraceSpec] = {
    "steady": TraceSpec(name="steady", rate_per_rank=16.0),
    # bursts every 4 s on average, 20 requests per rank within 5 ms, over a steady 10 per rank and second
    "bursty": TraceSpec(name="bursty", rate_per_rank=10.0, burst_every_s=4.0, burst_per_rank=20.0, burst_span_s=0.005),
    # 8 % of the prompts long (median 12 000 tokens), the rest short (median 300)
    "longshort": TraceSpec(name="longshort", rate_per_rank=10.0, short_prompt_median=300.0, long_fraction=0.08,
                           long_prompt_median=12000.0),
}


def scenario(name: str) -> TraceSpec:
    """The named scenario's spec; a clear error lists the names that exist."""
    try:
        return SCENARIOS[name]
    except KeyError:
        known = ", ".join(SCENARIOS)
        raise InvalidInputError(f"unknown trace {name!r}: use one of {known}") from None


@dataclass
class BlockTable:
    """Per request, the prompt's block ids, stored flat: request i's are ``ids[offsets[i]:offsets[i+1]]``."""

    offsets: np.ndarray  # int64, one more than there are requests
    ids: np.ndarray  # int64

    def rows(self) -> list[tuple[int, ...]]:
        flat = self.ids.tolist()
        bounds = self.offsets.tolist()
        return [tuple(flat[bounds[i] : bounds[i + 1]]) for i in range(len(bounds) - 1)]

    def take(self, index: np.ndarray) -> BlockTable:
        """The rows ``index`` (in that order)."""
        starts = self.offsets[index]
        lengths = self.offsets[index + 1] - starts
        offsets = np.zeros(index.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        gather = np.repeat(starts - offsets[:-1], lengths) + np.arange(int(offsets[-1]), dtype=np.int64)
        return BlockTable(offsets=offsets, ids=self.ids[gather])


@dataclass
class Trace:
    """Arrays of one trace, sorted by arrival time (ties keep the source's order)."""

    name: str
    n_ranks: int
    seed: int
    arrival_s: np.ndarray  # float64 seconds from the start
    prompt_len: np.ndarray  # int64 tokens
    output_len: np.ndarray  # int64 tokens to generate, >= 1
    is_burst: np.ndarray  # bool: came in a burst
    blocks: BlockTable | None = None  # prompt block ids, where the source has them
    spec: TraceSpec | None = None  # a synthetic scenario's spec
    info: dict[str, Any] = field(default_factory=dict)  # where a file trace came from and how it was shaped

    def __len__(self) -> int:
        return int(self.arrival_s.size)

    def block_rows(self) -> list[tuple[int, ...]]:
        """Each request's block ids (empty tuples when the trace has none)."""
        if self.blocks is None:
            return [()] * len(self)
        return self.blocks.rows()

    def summary(self) -> dict[str, float | int]:
        return {
            "requests": len(self),
            "burst_requests": int(self.is_burst.sum()),
            "prompt_tokens": int(self.prompt_len.sum()),
            "output_tokens": int(self.output_len.sum()),
            "last_arrival_s": float(self.arrival_s[-1]) if len(self) else 0.0,
            "prompt_blocks": int(self.blocks.ids.size) if self.blocks is not None else 0,
        }


def _lognormal_ints(
    rng: np.random.Generator, n: int, median: float, sigma: float, lo: int, hi: int
) -> np.ndarray:
    values = rng.lognormal(mean=np.log(median), sigma=sigma, size=n)
    return np.clip(np.rint(values), lo, hi).astype(np.int64)


def generate_trace(spec: TraceSpec, n_ranks: int, seed: int) -> Trace:
    """Draw the requests of ``spec`` for ``n_ranks`` ranks from a generator seeded with ``seed``."""
    if n_ranks < 1:
        raise InvalidInputError(f"a trace needs at least one rank, got n_ranks={n_ranks}")
    if spec.duration_s <= 0:
        raise InvalidInputError(f"trace duration must be > 0 seconds, got {spec.duration_s}")
    if spec.rate_per_rank < 0 or spec.burst_per_rank < 0 or spec.burst_every_s < 0:
        raise InvalidInputError("trace rates, burst sizes and burst gaps must be >= 0")
    if not 0.0 <= spec.long_fraction <= 1.0:
        raise InvalidInputError(f"long_fraction is a share in [0, 1], got {spec.long_fraction}")
    rng = np.random.default_rng(seed)

    # Background: a Poisson process, drawn as a count then uniform times (the same law, one call).
    rate = spec.rate_per_rank * n_ranks
    n_background = int(rng.poisson(rate * spec.duration_s)) if rate > 0 else 0
    times = [rng.uniform(0.0, spec.duration_s, size=n_background)]
    burst_flags = [np.zeros(n_background, dtype=bool)]

    if spec.burst_every_s > 0 and spec.burst_per_rank > 0:
        burst_size = max(1, round(spec.burst_per_rank * n_ranks))
        # The first burst comes after one mean gap, so the cluster is warm when it lands.
        start = float(rng.exponential(spec.burst_every_s)) + spec.burst_every_s / 2
        while start < spec.duration_s:
            times.append(start + rng.uniform(0.0, spec.burst_span_s, size=burst_size))
            burst_flags.append(np.ones(burst_size, dtype=bool))
            start += spec.burst_every_s / 2 + float(rng.exponential(spec.burst_every_s / 2))

    arrival = np.concatenate(times)
    is_burst = np.concatenate(burst_flags)
    order = np.argsort(arrival, kind="stable")
    arrival = arrival[order]
    is_burst = is_burst[order]
    n = arrival.size

    prompt = _lognormal_ints(
        rng, n, spec.short_prompt_median, spec.short_prompt_sigma, spec.prompt_min, spec.prompt_max
    )
    if spec.long_fraction > 0:
        is_long = rng.random(n) < spec.long_fraction
        long_prompt = _lognormal_ints(
            rng, n, spec.long_prompt_median, spec.long_prompt_sigma, spec.prompt_min, spec.prompt_max
        )
        prompt = np.where(is_long, long_prompt, prompt)
    output = _lognormal_ints(rng, n, spec.output_median, spec.output_sigma, 1, spec.output_max)
    return Trace(name=spec.name, spec=spec, n_ranks=n_ranks, seed=seed, arrival_s=arrival, prompt_len=prompt,
                 output_len=output, is_burst=is_burst)


# A scenario on a rank model other than the one its rates were set for runs at this share of that
# model's capacity unless told otherwise: below saturation, where the methods differ.
FOREIGN_PROFILE_LOAD = 0.75


def scenario_trace(
    name: str,
    n_ranks: int,
    seed: int,
    *,
    load: float | None,
    rank: Any = None,
    lockstep: Any = None,
    pd: tuple[int, int] | None = None,
    duration_s: float | None = None,
) -> Trace:
    """A named scenario for a run. Without ``rank`` (the ``synthetic`` profile, which the scenarios'
    rates were set for) ``load`` multiplies its rates (default 1.0). With another rank model its
    arrival times are scaled so that the work it offers is ``load`` (default ``FOREIGN_PROFILE_LOAD``)
    of that model's capacity, as a trace file's are (``dpboard.sim.workload``: the lockstep group's
    under ``lockstep``, the busier pool's under ``pd``)."""
    spec = scenario(name)
    if rank is None:
        return generate_trace(spec.scaled(load=1.0 if load is None else load, duration_s=duration_s), n_ranks, seed)
    from dpboard.sim.workload import LOCKSTEP_BASIS, RANK_BASIS, offered_loads

    target = FOREIGN_PROFILE_LOAD if load is None else load
    if not target > 0:
        raise InvalidInputError(f"--load must be > 0 (a share of the ranks' capacity, e.g. 0.8), got {target}")
    trace = generate_trace(spec.scaled(duration_s=duration_s), n_ranks, seed)
    span = trace.spec.duration_s if trace.spec is not None else float(trace.arrival_s.max())
    natural, independent = offered_loads(
        trace.prompt_len, trace.output_len, span, n_ranks, rank, lockstep=lockstep, pd=pd
    )
    scale = natural / target if natural > 0 else 1.0
    info = {
        "time_scale": scale,
        "natural_load": natural,
        "load": natural / scale,
        "load_basis": LOCKSTEP_BASIS if independent is not None else RANK_BASIS,
        "independent_load": None if independent is None else independent / scale,
    }
    return dataclasses.replace(trace, arrival_s=trace.arrival_s * scale, info=info)
