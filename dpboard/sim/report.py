"""Metrics, table, JSON and plot of ``dpboard sim`` runs.

Metrics per method:

- time to first token (TTFT) = end of the request's first prefill step - its arrival at the controller;
- queueing delay = first admission into a prefill batch - arrival;
- imbalance = max / mean of ``num_total_tokens`` across ranks (the true values, not the published
  ones), sampled every ``sample_period`` from the start to the last arrival; summarised as the
  load-weighted mean (sum of maxima over sum of means) and the p99 of busy samples;
- idle while queued = share of the loaded samples in that window in which some rank is idle while
  another has requests waiting that it has not admitted yet;
- cache hit rate = prompt tokens the rank's prefix cache held when the request was first admitted,
  over all prompt tokens (0 for a trace without block ids);
- time per output token (TPOT) of a request = (its finish - its first token) / (output tokens - 1),
  for requests of two tokens or more; p50 and p99 over requests;
- output tokens per second = every request's output tokens over the run (first arrival to last
  finish);
- goodput = requests per second over the same span that met both SLOs (TTFT <= ``slo_ttft``, and
  TPOT <= ``slo_tpot`` where it has one);
- idle rank-step share = rank-steps spent in an idle batch (DP attention: nothing to do while
  another rank of the group worked) over all rank-steps; 0 for independent ranks, which do not step
  when idle.

``Progress`` is what a run of many steps shows while it goes (``dpboard sim``'s methods, the
sweep's cells in tools/lockstep_sweep.py).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from dpboard.errors import UnavailableError
from dpboard.sim.workload import LOCKSTEP_BASIS

if TYPE_CHECKING:
    from dpboard.sim.simulation import RunResult, SimConfig
    from dpboard.sim.trace import Trace


def _pct(values: np.ndarray, q: float) -> float:
    return float(np.percentile(values, q)) if values.size else float("nan")


def _window(result: RunResult) -> tuple[np.ndarray, np.ndarray]:
    """Sample times and tokens [samples, ranks] from the start to the last arrival (the drain is left out)."""
    last_arrival = max((r.arrival_s for r in result.requests), default=0.0)
    keep = result.sample_t <= last_arrival
    return result.sample_t[keep], result.sample_tokens[keep].astype(np.float64)


def imbalance_series(result: RunResult, window_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(times, imbalance) over a moving window: sum of per-sample max over sum of per-sample mean.

    Weighting each sample by its load keeps near-empty moments (one request in the cluster reads
    as max/mean = ranks) from dominating the curve.
    """
    t, tokens = _window(result)
    if t.size == 0:
        return t, t
    peak = tokens.max(axis=1)
    mean = tokens.mean(axis=1)
    period = float(t[1] - t[0]) if t.size > 1 else 1.0
    width = max(1, round(window_s / period))
    kernel = np.ones(width)
    num = np.convolve(peak, kernel, mode="same")
    den = np.convolve(mean, kernel, mode="same")
    loaded = den > 0
    return t[loaded], num[loaded] / den[loaded]


def imbalance_stats(result: RunResult) -> tuple[float, float]:
    """(load-weighted mean, p99 over loaded samples) of max/mean tokens across ranks.

    The mean is sum(max) / sum(mean) over the samples up to the last arrival. The p99 is over the
    per-sample ratios of samples whose mean load is at least a quarter of the average, so that a
    lull with three requests in flight does not set the tail.
    """
    _, tokens = _window(result)
    if tokens.size == 0:
        return float("nan"), float("nan")
    peak = tokens.max(axis=1)
    mean = tokens.mean(axis=1)
    if mean.sum() <= 0:
        return float("nan"), float("nan")
    weighted = float(peak.sum() / mean.sum())
    busy = mean >= 0.25 * mean.mean()
    return weighted, _pct(peak[busy] / mean[busy], 99)


def tpot_s(result: RunResult) -> np.ndarray:
    """Per request of two output tokens or more: (finish - first token) / (output tokens - 1)."""
    return np.array(
        [(r.finished_s - r.first_token_s) / (r.output_len - 1) for r in result.requests if r.output_len > 1],
        dtype=np.float64,
    )


def goodput_mask(result: RunResult) -> np.ndarray:
    """Per request: did it meet both SLOs (a one-token answer has no TPOT to miss)?"""
    ttft_slo, tpot_slo = result.slo_ttft_s, result.slo_tpot_s
    return np.array(
        [
            r.first_token_s - r.arrival_s <= ttft_slo
            and (r.output_len <= 1 or (r.finished_s - r.first_token_s) / (r.output_len - 1) <= tpot_slo)
            for r in result.requests
        ],
        dtype=bool,
    )


def summarize(result: RunResult) -> dict[str, Any]:
    reqs = result.requests
    arrival = np.fromiter((r.arrival_s for r in reqs), np.float64, len(reqs))
    first = np.fromiter((r.first_token_s for r in reqs), np.float64, len(reqs))
    admitted = np.fromiter((r.admitted_s for r in reqs), np.float64, len(reqs))
    ranks = np.fromiter((r.rank for r in reqs), np.int64, len(reqs))
    burst = np.fromiter((r.is_burst for r in reqs), bool, len(reqs))
    prompt_tokens = sum(r.prompt_len for r in reqs)
    cached_tokens = sum(max(r.cached_tokens, 0) for r in reqs)
    ttft = first - arrival
    queue = admitted - arrival
    n_ranks = result.sample_tokens.shape[1]
    per_rank = np.bincount(ranks, minlength=n_ranks) if reqs else np.zeros(n_ranks, np.int64)
    imbalance_mean, imbalance_p99 = imbalance_stats(result)
    last_arrival = float(arrival.max()) if arrival.size else 0.0
    in_window = result.sample_t <= last_arrival
    loaded = result.sample_tokens[in_window].sum(axis=1) > 0
    iwq = result.sample_idle_while_queued[in_window][loaded]
    tpot = tpot_s(result)
    span = result.end_s - float(arrival.min()) if arrival.size else 0.0
    output_tokens = sum(r.output_len for r in reqs)
    good = int(goodput_mask(result).sum()) if reqs else 0
    pd = result.pd
    summary_pd: dict[str, Any] = {}
    if pd is not None:
        per_prefill = pd["prefill_requests_per_rank"]
        summary_pd = {
            "prefill_method": pd["prefill_method"],
            "decode_method": pd["decode_method"],
            "n_prefill": pd["n_prefill"],
            "n_decode": pd["n_decode"],
            "transfer_p50_ms": pd["transfer_p50_ms"],
            "transfer_p99_ms": pd["transfer_p99_ms"],
            "prefill_requests_per_rank_min": min(per_prefill),
            "prefill_requests_per_rank_max": max(per_prefill),
        }
    return {
        "method": f"{pd['prefill_method']}/{pd['decode_method']}" if pd is not None else result.method,
        "requests": len(reqs),
        "ttft_p50_ms": _pct(ttft, 50) * 1e3,
        "ttft_p90_ms": _pct(ttft, 90) * 1e3,
        "ttft_p99_ms": _pct(ttft, 99) * 1e3,
        "ttft_mean_ms": float(ttft.mean()) * 1e3 if ttft.size else float("nan"),
        "burst_ttft_p99_ms": _pct(ttft[burst], 99) * 1e3,
        "queue_p50_ms": _pct(queue, 50) * 1e3,
        "queue_p99_ms": _pct(queue, 99) * 1e3,
        "imbalance_mean": imbalance_mean,
        "imbalance_p99": imbalance_p99,
        "idle_while_queued": float(iwq.mean()) if iwq.size else 0.0,
        "cache_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else 0.0,
        "tpot_p50_ms": _pct(tpot, 50) * 1e3,
        "tpot_p99_ms": _pct(tpot, 99) * 1e3,
        "output_tokens_per_s": output_tokens / span if span > 0 else float("nan"),
        "goodput_rps": good / span if span > 0 else float("nan"),
        "goodput_share": good / len(reqs) if reqs else float("nan"),
        "slo_ttft_ms": result.slo_ttft_s * 1e3,
        "slo_tpot_ms": result.slo_tpot_s * 1e3,
        "lockstep": result.lockstep,
        "idle_rank_step_share": result.idle_rank_steps / result.rank_steps if result.rank_steps else 0.0,
        "extend_step_share": result.extend_steps / result.group_steps if result.group_steps else 0.0,
        "eager_decode_rank_steps": result.eager_decode_rank_steps,
        "delayer_held_passes": result.delayer_held_passes,
        "delayer_timeouts": result.delayer_timeouts,
        # per output token decoded: how many steps a running request went without a token, its
        # rank prefilling (SGLang runs a prefill batch alone)
        "stalled_decode_share": result.stalled_decodes / max(1, sum(r.output_len - 1 for r in result.requests)),
        # how long the controller held requests before sending them (inflight_wave's waves)
        "held_p99_ms": _pct(result.held_s, 99) * 1e3 if result.held_s is not None and len(reqs) else 0.0,
        "held_share": float(np.mean(result.held_s > 0)) if result.held_s is not None and len(reqs) else 0.0,
        "evicted_tokens": result.evicted_tokens,
        "requests_per_rank_min": int(per_rank.min()),
        "requests_per_rank_max": int(per_rank.max()),
        "retractions": result.retractions,
        "makespan_s": result.end_s,
        "publishes": result.publishes,
        "board_reads": result.board_reads,
        "wall_s": result.wall_s,
        **summary_pd,
    }


def describe_trace(trace: Trace) -> str:
    """One line on where the trace came from and how it was shaped."""
    s = trace.summary()
    info = trace.info
    if trace.spec is not None:
        scaled = ""
        if "time_scale" in info:
            scaled = (
                f"; times x{info['time_scale']:.4g} -> {s['last_arrival_s']:.0f} s, offered load "
                f"{_load_phrase(info)}"
            )
        return (
            f"trace {trace.name}: {s['requests']} requests ({s['burst_requests']} in bursts) over "
            f"{trace.spec.duration_s:g} s{scaled}, seed {trace.seed}"
        )
    lo, hi = info["window_s"]
    window = "" if (lo == 0 and hi is None) else f", window {lo:g}:{'' if hi is None else f'{hi:g}'} s"
    spread = ", bucketed times spread (seeded)" if info["spread"] else ""
    zero = f", {info['zero_outputs_run_as_1']} with 0 output tokens run as 1" if info["zero_outputs_run_as_1"] else ""
    blocks = f", {s['prompt_blocks']} prompt blocks with ids" if s["prompt_blocks"] else ", no block ids (no reuse)"
    return (
        f"trace {info['path']} ({info['format_label']}): {s['requests']} of {info['file_requests']} requests"
        f"{window}{spread}{zero}{blocks}; times x{info['time_scale']:.4g} -> {s['last_arrival_s']:.0f} s, "
        f"offered load {_load_phrase(info)} (as recorded: {info['natural_load']:.3f}); seed {trace.seed}"
    )


def _load_phrase(info: dict[str, Any]) -> str:
    """What the offered load is a share of, with the independent ranks' figure beside the lockstep one."""
    if info.get("load_basis") == LOCKSTEP_BASIS:
        return (
            f"{info['load']:.2f} of the lockstep group's capacity per rank ({info['independent_load']:.2f} "
            f"of an independent rank's)"
        )
    return f"{info['load']:.2f} of capacity per rank"


def header_text(
    trace: Trace, config: SimConfig, methods: list[str] | None = None, profile: str = "", *, chunk_rule: str = ""
) -> str:
    own = " (unless a method names its own cadence)" if any("cadence=" in m for m in methods or []) else ""
    pub = config.publish
    cadence = {
        "step": "every step",
        "sglang": f"every {pub.every_decode_steps} decode steps, forced on prefill and idle",
        "period": f"every {pub.period_s * 1e3:g} ms",
    }[pub.cadence]
    rank = config.rank
    chunk = f"chunked prefill {rank.chunked_prefill_size}" if rank.chunked_prefill_size else "no chunked prefill"
    if chunk_rule:
        chunk += f" ({chunk_rule})"
    named = f"profile {profile}: " if profile else ""
    stepping = "in lockstep (DP attention)" if config.lockstep is not None else "stepping independently"
    if config.prefill_delayer:
        stepping += ", SGLang's prefill delayer (30 passes)"
        if config.prefill_delayer_queue_min_ratio is not None:
            stepping += f" with its queue trigger (ratio {config.prefill_delayer_queue_min_ratio:g}, 5000 ms)"
    if config.overlap:
        stepping += ", overlap scheduler"
    pd = config.pd
    if pd is not None:
        stepping += (
            f", PD {pd.n_prefill} prefill : {pd.n_decode} decode (each pool its own controller; KV "
            f"{pd.kv_bytes_per_token:g} B per token over {pd.kv_link_bytes_per_s / 1e9:g} GB/s + "
            f"{pd.kv_transfer_base_s * 1e3:g} ms, bootstrap round trip {pd.bootstrap_rtt_s * 1e3:g} ms)"
        )
    slo = f"; goodput SLOs TTFT {config.slo_ttft_s * 1e3:g} ms, TPOT {config.slo_tpot_s * 1e3:g} ms"
    return (
        f"{describe_trace(trace)}\n"
        f"{config.n_ranks} ranks {stepping}, {named}KV {rank.kv_capacity} tokens, max running {rank.max_running}, {chunk}; "
        f"publish {cadence}{own}, visible after {pub.visibility_delay_s * 1e3:g} ms; refresh at most every "
        f"{config.refresh_interval_s * 1e3:g} ms{slo}\n"
    )


_COLUMNS = (
    ("method", "method", "{}"),
    ("p50 TTFT ms", "ttft_p50_ms", "{:.1f}"),
    ("p99 TTFT ms", "ttft_p99_ms", "{:.1f}"),
    ("p99 queue ms", "queue_p99_ms", "{:.1f}"),
    ("imbalance mean", "imbalance_mean", "{:.3f}"),
    ("imbalance p99", "imbalance_p99", "{:.3f}"),
    ("idle while queued", "idle_while_queued", "{:.1%}"),
    ("cache hit", "cache_hit_rate", "{:.1%}"),
    ("p99 TPOT ms", "tpot_p99_ms", "{:.1f}"),
    ("out tok/s", "output_tokens_per_s", "{:.0f}"),
    ("goodput req/s", "goodput_rps", "{:.2f}"),
    ("idle rank-steps", "idle_rank_step_share", "{:.1%}"),
    ("reqs/rank", None, None),
)


def table(summaries: list[dict[str, Any]]) -> str:
    """A markdown table, one row per method."""
    lines = [
        "| " + " | ".join(c[0] for c in _COLUMNS) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(_COLUMNS))) + "|",
    ]
    for s in summaries:
        cells = []
        for _, key, fmt in _COLUMNS:
            if key is None:
                cells.append(f"{s['requests_per_rank_min']}–{s['requests_per_rank_max']}")
            else:
                cells.append(fmt.format(s[key]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def to_json(
    trace: Trace,
    config: SimConfig,
    results: list[RunResult],
    summaries: list[dict[str, Any]],
    *,
    command: str = "",
    profile: dict[str, str] | None = None,
) -> dict[str, Any]:
    from dpboard.sim.simulation import config_dict

    runs = []
    for result, summary in zip(results, summaries, strict=True):
        t, ratio = imbalance_series(result)
        ttft = np.array([r.first_token_s - r.arrival_s for r in result.requests])
        tpot = tpot_s(result)
        quantiles = (1, 5, 10, 25, 50, 75, 90, 95, 99, 99.9)
        runs.append(
            {
                "summary": summary,
                "ttft_quantiles_ms": {str(q): _pct(ttft, q) * 1e3 for q in quantiles},
                "tpot_quantiles_ms": {str(q): _pct(tpot, q) * 1e3 for q in quantiles},
                "imbalance_series": {"t_s": t.round(4).tolist(), "max_over_mean": ratio.round(4).tolist()},
            }
        )
    return {
        "command": command,
        "trace": {
            "name": trace.name,
            "spec": dataclasses.asdict(trace.spec) if trace.spec is not None else None,
            "file": trace.info or None,
            "n_ranks": trace.n_ranks,
            "seed": trace.seed,
            **trace.summary(),
        },
        "profile": profile,
        "config": config_dict(config),
        "runs": runs,
    }


def write_json(doc: dict[str, Any], path: str) -> None:
    text = json.dumps(doc, indent=1, allow_nan=True)
    if path == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(path, "w") as f:
            f.write(text + "\n")


def _line_style(method: str) -> dict[str, Any]:
    # dpboard's own methods solid, the baselines (SGLang's, vLLM's) dashed
    from dpboard.sim.methods import method_row

    row = method_row(method.split(":")[0])
    ours = row is not None and row.is_improved
    return {"linewidth": 1.6 if ours else 1.2, "linestyle": "-" if ours else "--"}


def plot(results: list[RunResult], trace: Trace, config: SimConfig, path: str) -> None:
    """Two panels: each method's TTFT distribution (CDF, log time) and imbalance over time."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise UnavailableError(f"--plot needs matplotlib ({e}): pip install -e '.[plot]' (or matplotlib)") from e
    fig, (ax_ttft, ax_imb) = plt.subplots(1, 2, figsize=(13, 4.8))
    for result in results:
        ttft = np.sort([r.first_token_s - r.arrival_s for r in result.requests])
        if ttft.size:
            cdf = np.arange(1, ttft.size + 1) / ttft.size
            ax_ttft.plot(ttft * 1e3, cdf, label=result.method, **_line_style(result.method))
        t, ratio = imbalance_series(result)
        ax_imb.plot(t, ratio, label=result.method, **_line_style(result.method))
    ax_ttft.set_xscale("log")
    ax_ttft.set_xlabel("time to first token (ms, log)")
    ax_ttft.set_ylabel("share of requests")
    ax_ttft.set_title("TTFT distribution")
    ax_ttft.axhline(0.99, color="grey", linewidth=0.6, linestyle=":")
    ax_ttft.grid(True, which="both", alpha=0.3)
    ax_ttft.legend(fontsize=8)
    ax_imb.set_xlabel("simulated time (s)")
    ax_imb.set_ylabel("max / mean of num_total_tokens (1 s window)")
    ax_imb.set_title("load imbalance over time")
    ax_imb.grid(True, alpha=0.3)
    ax_imb.legend(fontsize=8)
    load = f", offered load {trace.info['load']:.2f}" if trace.info else ""
    fig.suptitle(
        f"dpboard sim: {trace.name}{load}, {config.n_ranks} ranks, seed {trace.seed}, "
        f"publish cadence {config.publish.cadence} unless a method names its own",
        fontsize=11,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _is_terminal(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Progress:
    """The progress of a command that runs for minutes, one step after another (``dpboard sim``'s
    methods, a sweep's cells): a rich progress bar on stderr when stderr is a terminal, gone when
    the command ends; otherwise nothing, so that a CI log and piped output (``--json -``) read as
    they did. ``lines``: each finished step's line (``done``) goes to stdout as a plain line, with a
    terminal or without, above the bar where there is one.

        with Progress(len(methods), "methods") as progress:
            for method in methods:
                progress.start(method)
                ...
                progress.done()
    """

    def __init__(self, total: int, unit: str, *, lines: bool = False, stream: TextIO | None = None) -> None:
        self.total = total
        self.unit = unit
        self.lines = lines
        self._stream = sys.stderr if stream is None else stream
        self._bar: Any = None
        self._task: Any = None
        self._part: Any = None

    @property
    def shown(self) -> bool:
        """Whether the bar is on the terminal."""
        return self._bar is not None

    def __enter__(self) -> Progress:
        if not _is_terminal(self._stream):
            return self
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, SpinnerColumn, TextColumn, TimeElapsedColumn
        from rich.progress import Progress as Bar

        self._bar = Bar(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[unit]}"),
            TimeElapsedColumn(),
            console=Console(file=self._stream),
            transient=True,
            # print() to a stdout that is the same terminal lands above the bar; a stdout that is
            # a file or a pipe is left alone, so that it gets exactly what it got without a bar
            redirect_stdout=_is_terminal(sys.stdout),
            redirect_stderr=True,
        )
        self._bar.start()
        self._task = self._bar.add_task("", total=self.total, unit=self.unit)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def start(self, name: str, parts: int = 0) -> None:
        """A step begins: the bar names it, and counts its ``parts`` (``part``) where it has some."""
        if self._bar is None:
            return
        if self._part is not None:
            self._bar.remove_task(self._part)
            self._part = None
        self._bar.update(self._task, description=name, refresh=True)
        if parts:
            self._part = self._bar.add_task("", total=parts, unit="runs")

    def part(self, name: str = "") -> None:
        """One part of the step is done (``name``: which, shown beside its count)."""
        if self._bar is not None and self._part is not None:
            self._bar.update(self._part, advance=1, description=f"  {name}" if name else "", refresh=True)

    def done(self, line: str = "") -> None:
        """The step is done; with ``lines``, ``line`` is printed on stdout."""
        if self.lines and line:
            print(line, flush=True)  # sys.stdout as it is now: the bar's proxy where stdout is the terminal
        if self._bar is not None:
            if self._part is not None:
                self._bar.remove_task(self._part)
                self._part = None
            self._bar.update(self._task, advance=1, refresh=True)
