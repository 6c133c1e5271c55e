"""Compare dispatch methods over several seeds with the simulator's library API.

One seed's p99 is one draw; this runs each method on the same traces for ``--seeds`` seeds and
prints, per method, the mean over seeds with the range beside it, then how the best of dpboard's
methods compares with SGLang's ``total_tokens``, vLLM's policy and the other peers' routers.

    python examples/compare_methods.py --trace bursty --ranks 16 --seeds 5
    python examples/compare_methods.py --trace longshort --methods \\
        "total_tokens:cadence=sglang,vllm,inflight_tokens:cadence=step"
    python examples/compare_methods.py --trace-file ../shared/traces/mooncake_conversation.jsonl \\
        --load 0.6 --ranks 16 --seeds 3

With ``--trace-file`` the seed shapes the trace where the format calls for it (Mooncake's
timestamps are spread within their buckets) and breaks the random ties of the routers that have
them; the rank model is ``--profile`` (default ``llama3.1-8b-h100``, as ``dpboard sim``).
Method specs are those of ``dpboard sim --methods`` (``NAME[:key=value;...]``, with ``cadence=`` to
give one method its own publish cadence).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dpboard.sim.cli import FILE_PROFILE, SCENARIO_PROFILE, split_methods
from dpboard.sim.profile import load_profile
from dpboard.sim.report import summarize
from dpboard.sim.simulation import PublishConfig, SimConfig, Simulation
from dpboard.sim.trace import SCENARIOS, generate_trace, scenario
from dpboard.sim.tracefile import parse_window, read_trace_file, shape_trace

METRICS = (
    ("p50 TTFT ms", "ttft_p50_ms", "{:.0f}"),
    ("p99 TTFT ms", "ttft_p99_ms", "{:.0f}"),
    ("p99 queue ms", "queue_p99_ms", "{:.0f}"),
    ("imbalance", "imbalance_mean", "{:.3f}"),
    ("imbalance p99", "imbalance_p99", "{:.3f}"),
    ("cache hit", "cache_hit_rate", "{:.1%}"),
)
DEFAULT_METHODS = (
    "total_requests,total_tokens,vllm,cache_aware,dynamo_kv,inflight_requests,inflight_tokens,inflight_backlog"
)
PEERS = ("total_tokens", "vllm", "cache_aware", "dynamo_kv")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", default=None, choices=sorted(SCENARIOS), help="synthetic scenario (default bursty)")
    source.add_argument("--trace-file", metavar="PATH", help="a real trace (Azure, Mooncake, BurstGPT)")
    p.add_argument("--load", type=float, default=None, help="--trace-file: offered load per rank (share of capacity)")
    p.add_argument("--window", metavar="START:END", help="--trace-file: a slice of the file, seconds")
    p.add_argument("--profile", default=None, help="rank profile (default as dpboard sim)")
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    p.add_argument("--cadence", default="sglang", choices=("step", "sglang", "period"))
    p.add_argument("--methods", default=DEFAULT_METHODS)
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")

    methods = split_methods(args.methods)
    profile = load_profile(args.profile or (FILE_PROFILE if args.trace_file else SCENARIO_PROFILE))
    config = SimConfig(n_ranks=args.ranks, rank=profile.rank, publish=PublishConfig(cadence=args.cadence))
    trace_file = read_trace_file(args.trace_file) if args.trace_file else None
    window = parse_window(args.window) if args.window else (None, None)
    per_method: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in range(args.seeds):
        if trace_file is not None:
            trace = shape_trace(trace_file, n_ranks=args.ranks, seed=seed, rank=profile.rank, window=window, load=args.load)
        else:
            trace = generate_trace(scenario(args.trace or "bursty"), args.ranks, seed)
        for method in methods:
            per_method[method].append(summarize(Simulation(trace, method, config).run()))

    name = args.trace_file or args.trace or "bursty"
    load = f", load {args.load:g}" if args.load is not None else ""
    print(
        f"{name}{load}, {args.ranks} ranks, profile {profile.name}, seeds 0..{args.seeds - 1}, cadence "
        f"{args.cadence} (unless a method names its own); mean over seeds [min–max]\n"
    )
    print("| method | " + " | ".join(m[0] for m in METRICS) + " |")
    print("|---|" + "---:|" * len(METRICS))
    means: dict[str, dict[str, float]] = {}
    for method, runs in per_method.items():
        cells = []
        means[method] = {}
        for _, key, fmt in METRICS:
            values = np.array([r[key] for r in runs])
            means[method][key] = float(values.mean())
            if values.min() == values.max():
                cells.append(fmt.format(values.mean()))
            else:
                cells.append(f"{fmt.format(values.mean())} [{fmt.format(values.min())}–{fmt.format(values.max())}]")
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
