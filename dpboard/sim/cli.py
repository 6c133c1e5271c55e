"""``dpboard sim``: the command line over the simulator (simulation.py) and its report (report.py)."""

from __future__ import annotations

import argparse
import sys

from dpboard.errors import InvalidInputError
from dpboard.sim import report as sim_report
from dpboard.sim.model import RankConfig
from dpboard.sim.simulation import CADENCES, PublishConfig, SimConfig, default_methods, simulate
from dpboard.sim.trace import SCENARIOS, Trace, generate_trace, scenario


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace", default="bursty", choices=sorted(SCENARIOS), help="named scenario (default bursty)"
    )
    p.add_argument("--ranks", type=int, default=8, help="DP ranks (default 8)")
    p.add_argument(
        "--duration", type=float, default=None, help="seconds of arrivals (default: the scenario's)"
    )
    p.add_argument(
        "--load", type=float, default=1.0, help="multiply the scenario's arrival rates (default 1.0)"
    )
    p.add_argument("--seed", type=int, default=0, help="trace seed (default 0)")
    p.add_argument(
        "--methods",
        default=None,
        help="comma-separated NAME[:key=value;...] specs. NAME: a controller method (round_robin, "
        "total_requests, total_tokens, inflight_requests, inflight_tokens, inflight_backlog) or vllm "
        "(vLLM's score). Options after ':' are separated by ';' here: "
        "Dispatcher keywords (refresh_interval=0, rotate_ties=false, ...) or cadence=step|sglang|period "
        "and publish_every=N for that method alone. Default: the seed methods, vllm and dpboard's methods",
    )
    p.add_argument("--cadence", default="sglang", choices=CADENCES, help="publish cadence (default sglang)")
    p.add_argument("--publish-every", type=int, default=15, help="sglang cadence: decode steps per publish")
    p.add_argument("--publish-period", type=float, default=0.01, help="period cadence: seconds per publish")
    p.add_argument(
        "--idle-publish", type=float, default=0.01, help="step/sglang cadence: idle republish period, s"
    )
    p.add_argument(
        "--visibility-delay", type=float, default=0.0, help="publish -> visible, seconds (default 0)"
    )
    p.add_argument(
        "--send-delay", type=float, default=0.0005, help="controller -> rank, seconds (default 0.0005)"
    )
    p.add_argument(
        "--refresh-interval", type=float, default=0.02, help="Dispatcher throttle, seconds (default 0.02)"
    )
    p.add_argument("--kv-capacity", type=int, default=RankConfig.kv_capacity, help="KV tokens per rank")
    p.add_argument(
        "--max-running", type=int, default=RankConfig.max_running, help="running batch limit per rank"
    )
    p.add_argument("--sample-period", type=float, default=0.05, help="metrics sampling period, seconds")
    p.add_argument("--json", metavar="PATH", help="write the full results as JSON here ('-' for stdout)")
    p.add_argument(
        "--plot", metavar="PNG", help="write TTFT distributions and imbalance over time (matplotlib)"
    )
    p.add_argument("--quick", action="store_true", help="a short run: 4 ranks, 10 s of arrivals")


def split_methods(text: str) -> list[str]:
    # Options inside one spec use ';' on the command line so that ',' can separate methods.
    return [m.strip().replace(";", ",") for m in text.split(",") if m.strip()]


def config_from_args(args: argparse.Namespace) -> tuple[SimConfig, Trace]:
    ranks = 4 if args.quick and args.ranks == 8 else args.ranks
    if args.seed < 0:
        raise InvalidInputError(f"--seed must be >= 0, got {args.seed}")
    duration = args.duration if args.duration is not None else (10.0 if args.quick else None)
    if duration is not None and duration <= 0:
        raise InvalidInputError(f"--duration must be > 0 seconds, got {duration}")
    config = SimConfig(
        n_ranks=ranks,
        rank=RankConfig(kv_capacity=args.kv_capacity, max_running=args.max_running),
        publish=PublishConfig(
            cadence=args.cadence,
            every_decode_steps=args.publish_every,
            period_s=args.publish_period,
            idle_publish_s=args.idle_publish,
            visibility_delay_s=args.visibility_delay,
        ),
        send_delay_s=args.send_delay,
        refresh_interval_s=args.refresh_interval,
        sample_period_s=args.sample_period,
    ).validate()
    spec = scenario(args.trace).scaled(load=args.load, duration_s=duration)
    return config, generate_trace(spec, ranks, args.seed)


def run(args: argparse.Namespace) -> int:
    config, trace = config_from_args(args)
    methods = split_methods(args.methods) if args.methods else default_methods()
    if not methods:
        raise InvalidInputError("--methods is empty: name at least one method, e.g. --methods total_tokens,vllm")
    results = simulate(trace, methods, config)
    summaries = [sim_report.summarize(r) for r in results]
    # With --json - the JSON owns stdout; the table goes to stderr so a pipe gets pure JSON.
    human = sys.stderr if args.json == "-" else sys.stdout
    print(sim_report.header_text(trace, config, methods), file=human)
    print(sim_report.table(summaries), file=human)
    if args.json:
        doc = sim_report.to_json(trace, config, results, summaries, command=_command_line(args))
        sim_report.write_json(doc, args.json)
    if args.plot:
        sim_report.plot(results, trace, config, args.plot)
        print(f"plot written to {args.plot}", file=human)
    return 0


def _command_line(args: argparse.Namespace) -> str:
    parts = ["dpboard sim", f"--trace {args.trace}", f"--ranks {args.ranks}", f"--seed {args.seed}"]
    for flag, value, default in (
        ("--duration", args.duration, None),
        ("--load", args.load, 1.0),
        ("--cadence", args.cadence, "sglang"),
        ("--visibility-delay", args.visibility_delay, 0.0),
        ("--refresh-interval", args.refresh_interval, 0.02),
    ):
        if value != default:
            parts.append(f"{flag} {value}")
    if args.methods:
        parts.append(f"--methods {args.methods}")
    if args.quick:
        parts.append("--quick")
    return " ".join(parts)
