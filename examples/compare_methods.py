"""Compare dispatch methods over several seeds with the simulator's library API.

One seed's p99 is one draw; this runs each method on the same traces for ``--seeds`` seeds and
prints, per method, the mean over seeds with the range beside it, then how the best of dpboard's
methods compares with SGLang's ``total_tokens``, vLLM's policy and the other peers' routers.

    python examples/compare_methods.py --trace bursty --ranks 8 --seeds 5
    python examples/compare_methods.py --trace longshort --methods \\
        "total_tokens:cadence=sglang,vllm,inflight_tokens:cadence=step"
    python examples/compare_methods.py --trace-file traces/mooncake_conversation.jsonl \\
        --load 0.6 --ranks 16 --seeds 3

The real traces are not shipped: docs/TRACES.md gives their sources and the commands that put them
in ``traces/``. With ``--trace-file`` the seed shapes the trace where the format calls for it (Mooncake's
timestamps are spread within their buckets) and breaks the random ties of the routers that have
them; the rank model is ``--profile`` (default ``llama3.1-8b-h100``, as ``dpboard sim``).
Method specs are those of ``dpboard sim --methods`` (``NAME[:key=value;...]``, with ``cadence=`` to
give one method its own publish cadence).

``--dp-attention`` steps the ranks in lockstep (the profile's setting by default), ``--pd P:D`` splits
prefill from decode (methods are then ``PREFILL/DECODE``), ``--chunked-prefill-size`` overrides the
profile's, ``--json PATH`` keeps every seed's summary; the DP-attention and PD cells of
docs/DISPATCH-RESULTS.md were run with them:

    python examples/compare_methods.py --trace-file traces/azure2023_conv.csv --pd 8:16 \\
        --profile deepseek-v3-dp-attention-h100 --load 0.9 --seeds 3 \\
        --methods follow_bootstrap_room/round_robin,total_tokens,inflight_cache:cadence=step

``--index-check`` looks at the controller's prefix index (methods that keep one: ``inflight_cache``)
against the ranks' true prefix caches, on the same traces:

- at every pick, the prompt tokens the index believed the picked rank held, what that rank's cache
  held at that instant, and what the cache of any rank held (the reuse on offer);
- the method again with its index replaced by the ranks' true caches, read at the dispatch instant:
  what an exact index fed by the engines' KV events, with no delay, would give (an upper bound);
- the method again with its index told at start that every rank holds the blocks that all prompts
  of the trace begin with (a shared system prompt): what a rank that has never been sent anything
  loses to that prefix.

    python examples/compare_methods.py --trace-file traces/mooncake_conversation.jsonl \\
        --load 0.9 --ranks 16 --seeds 3 --methods dynamo_kv,inflight_cache:cadence=step --index-check
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

import numpy as np

from dpboard.errors import DpboardError
from dpboard.options import count, positive
from dpboard.sim.cli import FILE_PROFILE, SCENARIO_PROFILE, split_methods
from dpboard.sim.pd import make_simulation
from dpboard.sim.prefix_cache import prefix_tokens
from dpboard.sim.profile import load_profile
from dpboard.sim.report import summarize
from dpboard.sim.simulation import PublishConfig, SimConfig, Simulation
from dpboard.sim.trace import SCENARIOS, Trace, scenario_trace
from dpboard.sim.tracefile import parse_window, read_trace_file, shape_trace
from dpboard.sim.transfer import parse_pd

METRICS = (
    ("p50 TTFT ms", "ttft_p50_ms", "{:.0f}"),
    ("p99 TTFT ms", "ttft_p99_ms", "{:.0f}"),
    ("p99 queue ms", "queue_p99_ms", "{:.0f}"),
    ("imbalance", "imbalance_mean", "{:.3f}"),
    ("imbalance p99", "imbalance_p99", "{:.3f}"),
    ("cache hit", "cache_hit_rate", "{:.1%}"),
    ("p99 TPOT ms", "tpot_p99_ms", "{:.0f}"),
    ("goodput req/s", "goodput_rps", "{:.2f}"),
    ("idle rank-steps", "idle_rank_step_share", "{:.1%}"),
)
DEFAULT_METHODS = (
    "total_requests,total_tokens,vllm,cache_aware,dynamo_kv,inflight_requests,inflight_tokens,inflight_backlog,"
    "inflight_cache,inflight_ttft"
)
PEERS = ("total_tokens", "vllm", "cache_aware", "dynamo_kv")
EXACT = " (exact caches)"
SEEDED = " (index seeded with the shared prefix)"


def seed_cell(values: list[float], fmt: str) -> str:
    """A table cell over seeds: the mean, and [min–max] beside it where the seeds differ."""
    values = np.asarray(values, dtype=float)
    text = fmt.format(values.mean())
    if values.min() != values.max():
        text += f" [{fmt.format(values.min())}–{fmt.format(values.max())}]"
    return text


def keeps_prefix_index(spec: str) -> bool:
    from dpboard.controller import LoadBalanceMethod

    try:
        return LoadBalanceMethod(spec.split(":")[0].strip()).uses_prefix_index
    except ValueError:  # a peer's router
        return False


class TrueCaches:
    """In place of the controller's PrefixIndex: every rank's prefix cache as it is at the dispatch
    instant, which an index fed by the engines' KV events with no delay would know."""

    def __init__(self, sim: Simulation, block_size: int):
        self.ranks = sim.ranks
        self.block_size = block_size

    def match(self, hashes: list[int], out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            out = np.zeros(len(self.ranks), np.int64)
        for r, rank in enumerate(self.ranks):
            out[r] = rank.cache.match(hashes) * self.block_size
        return out

    def record(self, rank: int, hashes: list[int]) -> None:
        pass  # the caches record what they hold themselves

    def set_capacity_tokens(self, capacities: list[int]) -> None:
        pass


class IndexProbe:
    """Counts, at every pick, the prompt tokens the method's index believed the picked rank held, what
    that rank's cache held at that instant, and how much more the fullest rank's cache held: reuse
    left there although the index knew of it (the cost preferred another rank), or because it did not."""

    KEYS = ("believed", "held", "over", "under", "left_known", "left_unknown")

    def __init__(self, sim: Simulation):
        self.prompt = 0
        self.counts = dict.fromkeys(self.KEYS, 0)
        dispatcher = sim.policy.dispatcher
        pick = sim.policy.dispatch
        c = self.counts

        def dispatch(req):
            ids, n = req.block_ids, req.prompt_len
            # a whole-prompt match covers its last, partial block: count at most the prompt
            believed = np.minimum(dispatcher.prefix.match(list(req.block_hashes)), n)
            rank = pick(req)
            held = [prefix_tokens(n, len(ids), r.cache.match(ids)) for r in sim.ranks]
            fullest = int(np.argmax(held))
            self.prompt += n
            c["believed"] += int(believed[rank])
            c["held"] += held[rank]
            c["over"] += max(0, int(believed[rank]) - held[rank])
            c["under"] += max(0, held[rank] - int(believed[rank]))
            left = held[fullest] - held[rank]
            c["left_known" if believed[fullest] >= held[fullest] else "left_unknown"] += left
            return rank

        sim.policy.dispatch = dispatch

    def shares(self) -> dict[str, float]:
        return {k: v / self.prompt if self.prompt else 0.0 for k, v in self.counts.items()}


def shared_prefix(trace: Trace) -> tuple[int, ...]:
    """The leading block ids that every prompt of the trace begins with."""
    rows = trace.block_rows()
    if not rows:
        return ()
    common = rows[0]
    for row in rows[1:]:
        k = 0
        while k < min(len(common), len(row)) and row[k] == common[k]:
            k += 1
        common = common[:k]
        if not common:
            break
    return tuple(common)


def runs_of(method: str, trace: Trace, config: SimConfig, index_check: bool):
    """(label, simulation, probe or None) for the method, and with --index-check its two variants."""
    sim = make_simulation(trace, method, config)
    if not (index_check and keeps_prefix_index(method)):
        yield method, sim, None
        return
    yield method, sim, IndexProbe(sim)
    exact = Simulation(trace, method, config)
    index = exact.policy.dispatcher.prefix
    exact.policy.dispatcher.prefix = TrueCaches(exact, index.block_size)
    yield method + EXACT, exact, IndexProbe(exact)
    seeded = Simulation(trace, method, config)
    shared = list(shared_prefix(trace))
    for rank in range(config.n_ranks):
        seeded.policy.dispatcher.prefix.record(rank, shared)
    yield method + SEEDED, seeded, IndexProbe(seeded)


def print_tables(methods: list[str], per_method: dict[str, list[dict]], probes: dict[str, list[IndexProbe]]) -> None:
    """Every method's row (mean over seeds [range]), the best dpboard method against the peers, and the
    index check's shares where it ran."""
    print("| method | " + " | ".join(m[0] for m in METRICS) + " |")
    print("|---|" + "---:|" * len(METRICS))
    means: dict[str, dict[str, float]] = {}
    for method, runs in per_method.items():
        cells = []
        means[method] = {}
        for _, key, fmt in METRICS:
            values = [r[key] for r in runs]
            means[method][key] = float(np.mean(values))
            cells.append(seed_cell(values, fmt))
        print(f"| {method} | " + " | ".join(cells) + " |")

    ours = [m for m in methods if m.split(":")[0].startswith("inflight_")]
    baselines = [m for m in methods if m.split(":")[0] in PEERS]
    if ours and baselines:
        best = min(ours, key=lambda m: means[m]["ttft_p99_ms"])
        print(f"\nbest dpboard method by p99 TTFT: {best}")
        for base in baselines:
            d_ttft = means[best]["ttft_p99_ms"] / means[base]["ttft_p99_ms"] - 1
            d_imb = means[best]["imbalance_mean"] / means[base]["imbalance_mean"] - 1
            print(f"  vs {base}: p99 TTFT {d_ttft:+.1%}, imbalance {d_imb:+.1%}")
    if probes:
        print("\nprefix index against the ranks' caches at each pick, share of all prompt tokens, mean over seeds:\n")
        print("| method | the index believed the picked rank held | the picked rank's cache held | index over "
              "| index under | more on the fullest rank, the index knew | more on the fullest rank, unknown to the index |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for label, runs in probes.items():
            shares = [run.shares() for run in runs]
            cells = [f"{np.mean([s[k] for s in shares]):.1%}" for k in IndexProbe.KEYS]
            print(f"| {label} | " + " | ".join(cells) + " |")


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The description as written, and every option's default shown (where it has one)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", default=None, choices=sorted(SCENARIOS), help="synthetic scenario (bursty when no --trace-file)")
    source.add_argument("--trace-file", metavar="PATH", help="a real trace (Azure, Mooncake, BurstGPT)")
    p.add_argument("--load", type=positive(100), default=None,
                   help="offered load per rank, a share of its capacity (default: a --trace-file as recorded, "
                        "a --trace scenario at 1.0), as dpboard sim --load")
    p.add_argument("--window", metavar="START:END", help="--trace-file: a slice of the file, seconds")
    p.add_argument("--profile", default=None,
                   help=f"rank profile (default as dpboard sim: {SCENARIO_PROFILE}, {FILE_PROFILE} with --trace-file)")
    p.add_argument("--ranks", type=count(1, 4096), default=8, help="DP ranks (as dpboard sim)")
    p.add_argument("--seeds", type=count(1, 1000), default=5, help="seeds 0..N-1")
    p.add_argument("--cadence", default="sglang", choices=("step", "sglang", "period"),
                   help="publish cadence of the methods that do not name their own")
    p.add_argument("--methods", default=DEFAULT_METHODS, help="comma-separated specs, as dpboard sim --methods")
    p.add_argument("--dp-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="ranks in lockstep as DP attention runs them (default: the profile's)")
    p.add_argument("--pd", metavar="P:D", default=None,
                   help="PD disaggregation: P prefill and D decode ranks (methods are PREFILL/DECODE, as dpboard sim)")
    p.add_argument("--chunked-prefill-size", type=int, default=None,
                   help="prompt tokens per prefill step per rank, 0 = off (default as dpboard sim: the profile's, "
                        "SGLang's rule for colocated ranks in lockstep)")
    p.add_argument("--prefill-delayer", action="store_true",
                   help="every method with SGLang's prefill delayer (a method alone: prefill_delayer=on in its spec)")
    p.add_argument("--json", metavar="PATH", help="write every seed's summary of every method here")
    p.add_argument("--index-check", action="store_true",
                   help="the prefix index against the ranks' true caches, and two variants of the method (see above)")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")

    methods = split_methods(args.methods)
    if args.index_check and not any(keeps_prefix_index(m) for m in methods):
        p.error("--index-check needs a method that keeps a prefix index among --methods (inflight_cache)")
    profile = load_profile(args.profile or (FILE_PROFILE if args.trace_file else SCENARIO_PROFILE))
    if args.chunked_prefill_size is not None:
        rank = dataclasses.replace(profile.rank, chunked_prefill_size=args.chunked_prefill_size).validate()
        profile = dataclasses.replace(profile, rank=rank)
    pd = profile.pd(*parse_pd(args.pd)) if args.pd else None
    if pd is not None:
        args.ranks = pd.n_ranks
    dp_attention = profile.dp_attention if args.dp_attention is None else args.dp_attention
    rank, _ = profile.run_rank(args.ranks, dp_attention=dp_attention, pd=pd is not None,
                               chunk_given=args.chunked_prefill_size is not None)
    config = SimConfig(
        n_ranks=args.ranks, rank=rank, publish=PublishConfig(cadence=args.cadence),
        lockstep=profile.lockstep if dp_attention else None, pd=pd,
        slo_ttft_s=profile.slo_ttft_s, slo_tpot_s=profile.slo_tpot_s, prefill_delayer=args.prefill_delayer,
    )  # fmt: skip
    trace_file = read_trace_file(args.trace_file) if args.trace_file else None
    window = parse_window(args.window) if args.window else (None, None)
    per_method: dict[str, list[dict]] = {}
    probes: dict[str, list[IndexProbe]] = {}
    for seed in range(args.seeds):
        if trace_file is not None:
            trace = shape_trace(trace_file, n_ranks=args.ranks, seed=seed, rank=rank, window=window,
                                load=args.load, pd=(pd.n_prefill, pd.n_decode) if pd is not None else None,
                                lockstep=config.lockstep)  # fmt: skip
        else:
            own = profile.name == SCENARIO_PROFILE
            trace = scenario_trace(args.trace or "bursty", args.ranks, seed, load=args.load,
                                   rank=None if own else rank, lockstep=config.lockstep,
                                   pd=(pd.n_prefill, pd.n_decode) if pd is not None else None)  # fmt: skip
        for method in methods:
            for label, sim, probe in runs_of(method, trace, config, args.index_check):
                per_method.setdefault(label, []).append(summarize(sim.run()))
                if probe is not None:
                    probes.setdefault(label, []).append(probe)

    name = args.trace_file or args.trace or "bursty"
    load = f", load {args.load:g}" if args.load is not None else ""
    stepping = ", lockstep (DP attention)" if dp_attention else ""
    split = f", PD {pd.n_prefill}:{pd.n_decode}" if pd is not None else ""
    print(
        f"{name}{load}, {args.ranks} ranks{split}{stepping}, profile {profile.name}, seeds 0..{args.seeds - 1}, cadence "
        f"{args.cadence} (unless a method names its own); mean over seeds [min–max]\n"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"trace": name, "load": args.load, "ranks": args.ranks, "pd": args.pd,
                       "dp_attention": dp_attention, "profile": profile.name, "seeds": args.seeds,
                       "runs": per_method}, f, indent=1)  # fmt: skip
    print_tables(methods, per_method, probes)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except DpboardError as e:  # a missing trace file, a bad method spec: one line, as dpboard sim
        print(f"compare_methods.py: {e}", file=sys.stderr)
        raise SystemExit(2) from None
