"""``dpboard sim``: the command line over the simulator (simulation.py) and its report (report.py).
While the methods run, one after another, a terminal on stderr shows a progress bar over them
(``report.Progress``); without one nothing is added to the output."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import sys

from dpboard.errors import InvalidInputError, UnavailableError
from dpboard.options import output_file
from dpboard.sim import report as sim_report
from dpboard.sim.methods import VLLM_BOARD, VLLM_BOARD_METHOD, controller_methods
from dpboard.sim.pd import simulate_any
from dpboard.sim.peers import PEERS
from dpboard.sim.profile import Profile, load_profile, load_profile_file, profile_names
from dpboard.sim.simulation import CADENCES, PublishConfig, SimConfig, default_methods
from dpboard.sim.trace import SCENARIOS, Trace, scenario_trace
from dpboard.sim.tracefile import parse_window, read_trace_file, shape_trace
from dpboard.sim.transfer import parse_pd

DEFAULT_SCENARIO = "bursty"
SCENARIO_PROFILE = "synthetic"  # the model the synthetic scenarios were made for
FILE_PROFILE = "llama3.1-8b-h100"  # real traces run on a calibrated model unless told otherwise


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``dpboard sim``'s options, by subject: the workload, the methods, the rank model, the goodput
    SLOs with how loads are published and read, and what the run writes."""
    _add_workload_arguments(p)
    _add_method_arguments(p)
    _add_rank_model_arguments(p)
    _add_measuring_arguments(p)
    _add_output_arguments(p)


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    source = p.add_mutually_exclusive_group()
    source.add_argument(
        "--trace", default=None, choices=sorted(SCENARIOS), help=f"named synthetic scenario (default {DEFAULT_SCENARIO})"
    )
    source.add_argument(
        "--trace-file",
        metavar="PATH",
        help="a real trace: Azure LLM inference CSV, Mooncake JSON lines (with prefix block ids) or "
        "BurstGPT CSV, recognised from its first line",
    )
    p.add_argument("--ranks", type=int, default=8, help="DP ranks (default 8)")
    p.add_argument(
        "--load",
        type=float,
        default=None,
        help="with --trace-file: scale arrival times so the offered work per rank is this share of a "
        "rank's capacity (e.g. 0.8; default: the file's own timing), of the lockstep group's under "
        "--dp-attention, of the busier pool's under --pd; with --trace on the synthetic profile: "
        "multiply the scenario's arrival rates (default 1.0), on another profile: that share of its "
        "capacity, as a file's (default 0.75)",
    )
    p.add_argument("--window", metavar="START:END", help="--trace-file: only requests in this span of the file, seconds")
    p.add_argument(
        "--no-spread",
        action="store_true",
        help="--trace-file: keep bucketed timestamps (Mooncake's 3 s buckets) as written instead of "
        "spreading each bucket's requests uniformly (seeded)",
    )
    p.add_argument(
        "--duration", type=float, default=None, help="--trace: seconds of arrivals (default: the scenario's)"
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the synthetic trace, the spread and random ties (default 0)")


def _add_method_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--methods",
        default=None,
        # the names the run accepts, from the same lists it checks against
        help="comma-separated NAME[:key=value;...] specs. NAME: a controller method "
        f"({', '.join(['auto', *controller_methods()])}), a peer's router ({', '.join(PEERS)}), or {VLLM_BOARD} "
        f"(vLLM's API server picking through the board with {VLLM_BOARD_METHOD}); with --pd, PREFILL/DECODE. "
        "Options after ':' are separated by ';' here: "
        "Dispatcher keywords (refresh_interval=0, rotate_ties=false, ...), the peer's parameters, or "
        "cadence=step|sglang|period, publish_every=N and prefill_delayer=on|off for that method alone. Default: the seed "
        "methods, the peers and dpboard's methods",
    )


def _add_rank_model_arguments(p: argparse.ArgumentParser) -> None:
    prof = p.add_mutually_exclusive_group()
    prof.add_argument(
        "--profile",
        default=None,
        help=f"rank model: {', '.join(profile_names())} (default {SCENARIO_PROFILE} with --trace, "
        f"{FILE_PROFILE} with --trace-file)",
    )
    prof.add_argument("--profile-file", metavar="PATH", help="rank model from your own profile file")
    p.add_argument("--kv-capacity", type=int, default=None, help="KV tokens per rank (default: the profile's)")
    p.add_argument("--max-running", type=int, default=None, help="running batch limit per rank (default: the profile's)")
    p.add_argument(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="prompt tokens per prefill step per rank, 0 = off (default: the profile's; for colocated "
        "ranks in lockstep SGLang's rule, its --chunked-prefill-size over the ranks: 8192 / 16 = 512 "
        "per rank on deepseek-v3-dp-attention-h100)",
    )
    p.add_argument(
        "--dp-attention",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="ranks step in lockstep as SGLang's DP attention runs them: a step lasts as long as the "
        "slowest rank's, one rank's prefill makes it an extend step for all, idle ranks run idle "
        "batches (default: the profile's dp_attention; on for deepseek-v3-dp-attention-h100)",
    )
    p.add_argument(
        "--prefill-delayer",
        action="store_true",
        help="SGLang's --enable-prefill-delayer with its defaults (lockstep groups only): when some "
        "ranks but not all could prefill, hold prefill back for up to 30 passes so that they prefill "
        "together; inflight_lockstep then takes the SGLang plugin's horizon there, 2 group steps",
    )
    p.add_argument(
        "--prefill-delayer-queue-min-ratio",
        type=float,
        default=None,
        metavar="RATIO",
        help="with --prefill-delayer, SGLang's queue trigger (off by default): when every rank could "
        "prefill, also hold prefill back while the longest waiting queue is below RATIO x the largest "
        "running batch (at most the largest recent prefill batch), for up to 5000 ms or 30 passes",
    )
    p.add_argument(
        "--overlap-schedule",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="SGLang's overlap scheduler: a request received during a step is admitted one step later "
        "(default: on with --dp-attention, as SGLang runs; off for independent ranks, the model of the "
        "earlier independent-rank results)",
    )
    p.add_argument(
        "--new-token-ratio",
        type=float,
        default=0.0,
        help="admission keeps this share of the running requests' remaining outputs free in the KV "
        "pool, SGLang's new_token_ratio held constant (0.21 is its start under DP attention: 0.7 x "
        "schedule_conservativeness x 0.3); default 0: none kept, a decode step that overflows retracts",
    )
    p.add_argument(
        "--pd",
        metavar="P:D",
        default=None,
        help="PD disaggregation: P prefill ranks and D decode ranks (each pool its own controller, in "
        "lockstep under --dp-attention), KV transfer between them; a method is then PREFILL/DECODE "
        "(e.g. follow_bootstrap_room/round_robin, SGLang's auto), a single name both sides",
    )


def _add_measuring_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slo-ttft-ms", type=float, default=None, help="goodput: time-to-first-token SLO, ms (default: the profile's)"
    )
    p.add_argument(
        "--slo-tpot-ms", type=float, default=None, help="goodput: time-per-output-token SLO, ms (default: the profile's)"
    )
    p.add_argument("--cadence", default="sglang", choices=CADENCES, help="publish cadence (default sglang)")
    p.add_argument("--publish-every", type=int, default=15, help="sglang cadence: decode steps per publish")
    p.add_argument("--publish-period", type=float, default=0.01, help="period cadence: seconds per publish")
    p.add_argument(
        "--idle-publish", type=float, default=0.01, help="step/sglang cadence: idle republish period, s"
    )
    p.add_argument(
        "--visibility-delay", type=float, default=0.0, help="publish (and KV event) -> visible, seconds (default 0)"
    )
    p.add_argument(
        "--send-delay", type=float, default=0.0005, help="controller -> rank, seconds (default 0.0005)"
    )
    p.add_argument(
        "--refresh-interval", type=float, default=0.02, help="Dispatcher throttle, seconds (default 0.02)"
    )
    p.add_argument("--sample-period", type=float, default=0.05, help="metrics sampling period, seconds")
    p.add_argument(
        "--queued-prefill",
        default="sglang",
        choices=("sglang", "exact"),
        help="the queued prefill ranks report: SGLang's own estimate (default) or the exact uncached "
        "tokens an engine that matched its waiting queue could report",
    )


def _add_output_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", help="write the full results as JSON here ('-' for stdout)")
    p.add_argument(
        "--plot", metavar="PNG", type=output_file, help="write TTFT distributions and imbalance over time (matplotlib)"
    )
    p.add_argument("--quick", action="store_true", help="a short run: 4 ranks, 10 s of arrivals")


def split_methods(text: str) -> list[str]:
    # Options inside one spec use ';' on the command line so that ',' can separate methods.
    return [m.strip().replace(";", ",") for m in text.split(",") if m.strip()]


def profile_from_args(args: argparse.Namespace) -> Profile:
    if args.profile_file:
        profile = load_profile_file(args.profile_file)
    else:
        profile = load_profile(args.profile or (FILE_PROFILE if args.trace_file else SCENARIO_PROFILE))
    overrides = {
        field: value
        for field, value in (
            ("kv_capacity", args.kv_capacity),
            ("max_running", args.max_running),
            ("chunked_prefill_size", args.chunked_prefill_size),
        )
        if value is not None
    }
    if overrides:
        profile = dataclasses.replace(profile, rank=dataclasses.replace(profile.rank, **overrides).validate())
    return profile


def config_from_args(args: argparse.Namespace) -> tuple[SimConfig, Trace, Profile]:
    ranks = 4 if args.quick and args.ranks == 8 else args.ranks
    if args.seed < 0:
        raise InvalidInputError(f"--seed must be >= 0, got {args.seed}")
    profile = profile_from_args(args)
    pd = None
    if args.pd:
        n_prefill, n_decode = parse_pd(args.pd)
        if args.ranks not in (8, n_prefill + n_decode):
            raise InvalidInputError(f"--ranks {args.ranks} and --pd {args.pd} disagree: leave --ranks out with --pd")
        pd = profile.pd(n_prefill, n_decode)
        ranks = pd.n_ranks
    dp_attention = profile.dp_attention if args.dp_attention is None else args.dp_attention
    rank, _ = profile.run_rank(
        ranks, dp_attention=dp_attention, pd=pd is not None, chunk_given=args.chunked_prefill_size is not None
    )
    if args.new_token_ratio:
        rank = dataclasses.replace(rank, new_token_ratio=args.new_token_ratio).validate()
    config = SimConfig(
        n_ranks=ranks,
        rank=rank,
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
        queued_prefill=args.queued_prefill,
        lockstep=profile.lockstep if dp_attention else None,
        frontend_s=profile.frontend_s,
        slo_ttft_s=profile.slo_ttft_s if args.slo_ttft_ms is None else args.slo_ttft_ms / 1e3,
        slo_tpot_s=profile.slo_tpot_s if args.slo_tpot_ms is None else args.slo_tpot_ms / 1e3,
        pd=pd,
        prefill_delayer=args.prefill_delayer,
        prefill_delayer_queue_min_ratio=args.prefill_delayer_queue_min_ratio,
        overlap_schedule=args.overlap_schedule,
    ).validate()
    if args.trace_file:
        if args.duration is not None:
            raise InvalidInputError("--duration is for the synthetic scenarios: take a slice of a trace file with --window START:END")
        window = parse_window(args.window) if args.window else (None, None)
        trace = shape_trace(
            read_trace_file(args.trace_file),
            n_ranks=ranks,
            seed=args.seed,
            rank=config.rank,
            window=window,
            spread=not args.no_spread,
            load=args.load,
            pd=(pd.n_prefill, pd.n_decode) if pd is not None else None,
            lockstep=config.lockstep,
        )
        return config, trace, profile
    if args.window or args.no_spread:
        raise InvalidInputError("--window and --no-spread apply to --trace-file only")
    duration = args.duration if args.duration is not None else (10.0 if args.quick else None)
    if duration is not None and duration <= 0:
        raise InvalidInputError(f"--duration must be > 0 seconds, got {duration}")
    own = profile.name == SCENARIO_PROFILE and not args.profile_file
    trace = scenario_trace(
        args.trace or DEFAULT_SCENARIO,
        ranks,
        args.seed,
        load=args.load,
        rank=None if own else config.rank,
        lockstep=config.lockstep,
        pd=(pd.n_prefill, pd.n_decode) if pd is not None else None,
        duration_s=duration,
    )
    return config, trace, profile


def run(args: argparse.Namespace) -> int:
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # checked before the run, which can take minutes, rather than failing after it
        raise UnavailableError("--plot needs matplotlib: pip install matplotlib (or the wheel's [plot] extra)")
    config, trace, profile = config_from_args(args)
    methods = split_methods(args.methods) if args.methods else default_methods()
    if not methods:
        raise InvalidInputError("--methods is empty: name at least one method, e.g. --methods total_tokens,vllm")
    # one method after another (what simulate_any does), so that a terminal sees which one runs
    results = []
    with sim_report.Progress(len(methods), "methods") as progress:
        for method in methods:
            progress.start(method)
            results += simulate_any(trace, [method], config)
            progress.done()
    summaries = [sim_report.summarize(r) for r in results]
    # With --json - the JSON owns stdout; the table goes to stderr so a pipe gets pure JSON.
    human = sys.stderr if args.json == "-" else sys.stdout
    _, chunk_rule = profile.run_rank(
        config.n_ranks,
        dp_attention=config.lockstep is not None,
        pd=config.pd is not None,
        chunk_given=args.chunked_prefill_size is not None,
    )
    print(sim_report.header_text(trace, config, methods, profile.name, chunk_rule=chunk_rule), file=human)
    print(sim_report.table(summaries), file=human)
    if args.json:
        doc = sim_report.to_json(
            trace, config, results, summaries, command=_command_line(args), profile=profile.as_dict()
        )
        sim_report.write_json(doc, args.json)
    if args.plot:
        sim_report.plot(results, trace, config, args.plot)
        print(f"plot written to {args.plot}", file=human)
    return 0


def _command_line(args: argparse.Namespace) -> str:
    parts = ["dpboard sim"]
    if args.trace_file:
        parts.append(f"--trace-file {args.trace_file}")
    else:
        parts.append(f"--trace {args.trace or DEFAULT_SCENARIO}")
    parts += [f"--ranks {args.ranks}", f"--seed {args.seed}"]
    for flag, value, default in (
        ("--load", args.load, None),
        ("--window", args.window, None),
        ("--duration", args.duration, None),
        ("--profile", args.profile, None),
        ("--profile-file", args.profile_file, None),
        ("--kv-capacity", args.kv_capacity, None),
        ("--max-running", args.max_running, None),
        ("--chunked-prefill-size", args.chunked_prefill_size, None),
        ("--cadence", args.cadence, "sglang"),
        ("--visibility-delay", args.visibility_delay, 0.0),
        ("--refresh-interval", args.refresh_interval, 0.02),
        ("--queued-prefill", args.queued_prefill, "sglang"),
        ("--pd", args.pd, None),
        ("--slo-ttft-ms", args.slo_ttft_ms, None),
        ("--slo-tpot-ms", args.slo_tpot_ms, None),
        ("--new-token-ratio", args.new_token_ratio, 0.0),
        ("--prefill-delayer-queue-min-ratio", args.prefill_delayer_queue_min_ratio, None),
    ):
        if value != default:
            parts.append(f"{flag} {value}")
    if args.dp_attention is not None:
        parts.append("--dp-attention" if args.dp_attention else "--no-dp-attention")
    if args.overlap_schedule is not None:
        parts.append("--overlap-schedule" if args.overlap_schedule else "--no-overlap-schedule")
    if args.prefill_delayer:
        parts.append("--prefill-delayer")
    if args.no_spread:
        parts.append("--no-spread")
    if args.methods:
        parts.append(f"--methods {args.methods}")
    if args.quick:
        parts.append("--quick")
    return " ".join(parts)
