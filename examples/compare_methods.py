"""Compare dispatch methods over several seeds with the simulator's library API.

One seed's p99 is one draw; this runs each method on the same traces for ``--seeds`` seeds and
prints, per method, the mean over seeds with the range beside it, then how the best of dpboard's
methods compares with SGLang's ``total_tokens`` and vLLM's score.

    python examples/compare_methods.py --trace bursty --ranks 16 --seeds 5
    python examples/compare_methods.py --trace longshort --methods \\
        "total_tokens:cadence=sglang,vllm,inflight_tokens:cadence=step"

Method specs are those of ``dpboard sim --methods`` (``NAME[:key=value;...]``, with ``cadence=`` to
give one method its own publish cadence).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

from dpboard.sim.cli import split_methods
from dpboard.sim.report import summarize
from dpboard.sim.simulation import PublishConfig, SimConfig, Simulation
from dpboard.sim.trace import SCENARIOS, generate_trace, scenario

METRICS = (
    ("p50 TTFT ms", "ttft_p50_ms", "{:.0f}"),
    ("p99 TTFT ms", "ttft_p99_ms", "{:.0f}"),
    ("p99 queue ms", "queue_p99_ms", "{:.0f}"),
    ("imbalance", "imbalance_mean", "{:.3f}"),
    ("imbalance p99", "imbalance_p99", "{:.3f}"),
)
DEFAULT_METHODS = "total_requests,total_tokens,vllm,inflight_requests,inflight_tokens,inflight_backlog"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trace", default="bursty", choices=sorted(SCENARIOS))
    p.add_argument("--ranks", type=int, default=16)
    p.add_argument("--seeds", type=int, default=5, help="seeds 0..N-1 (default 5)")
    p.add_argument("--cadence", default="sglang", choices=("step", "sglang", "period"))
    p.add_argument("--methods", default=DEFAULT_METHODS)
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be >= 1")

    methods = split_methods(args.methods)
    config = SimConfig(n_ranks=args.ranks, publish=PublishConfig(cadence=args.cadence))
    per_method: dict[str, list[dict]] = {m: [] for m in methods}
    for seed in range(args.seeds):
        trace = generate_trace(scenario(args.trace), args.ranks, seed)
        for method in methods:
            per_method[method].append(summarize(Simulation(trace, method, config).run()))

    print(
        f"{args.trace}, {args.ranks} ranks, seeds 0..{args.seeds - 1}, cadence {args.cadence} "
        f"(unless a method names its own); mean over seeds [min–max]\n"
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
            cells.append(
                f"{fmt.format(values.mean())} [{fmt.format(values.min())}–{fmt.format(values.max())}]"
            )
        print(f"| {method} | " + " | ".join(cells) + " |")

    ours = [m for m in methods if m.split(":")[0].startswith("inflight_")]
    baselines = [m for m in methods if m.split(":")[0] in ("total_tokens", "vllm")]
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
