"""The DP-attention cells of docs/DISPATCH-RESULTS.md ("DP attention: the second pass, measured"): run
them, one cell per JSON file; condense them into the results data; and render every results table.

    python tools/lockstep_sweep.py run --out out/lockstep            # every cell not yet in --out
    python tools/lockstep_sweep.py run --out out/lockstep --only azure-16-0.9
    python tools/lockstep_sweep.py collect --out out/lockstep         # -> docs/results/lockstep-sweep.json
    python tools/lockstep_sweep.py table                              # docs/DISPATCH-RESULTS.md's tables and pictures
    python tools/lockstep_sweep.py table --check                      # exit 1 where they differ from the data
    python tools/lockstep_sweep.py picture --only lockstep-cells     # draw a study's picture again (matplotlib)
    python tools/lockstep_sweep.py table --out out/lockstep --cells   # a sweep's tables, printed

A cell is a trace (the first 1,200 s of the Azure conversation and Mooncake conversation files, or
the ``bursty`` and ``longshort`` scenarios), a rank count (8, 16, 32) and a load (0.5, 0.75, 0.9 of
the lockstep group's capacity), on ``deepseek-v3-dp-attention-h100`` with SGLang's chunk rule, each
method with and without SGLang's prefill delayer, SGLang's three with its queue trigger too
(``+delayer +queue``, ratio ``QUEUE_RATIO``) (``inflight_lockstep`` with the delayer takes the
horizon the SGLang plugin gives it there, ``DELAYER_LOCKSTEP_HORIZON``). Seeds 0-2 where the seed
changes the run: every method on Mooncake (the bucket spread) and on the scenarios (the draw), only the seeded routers
(vLLM's, Dynamo's) on Azure. The sensitivity cells rerun the 16-rank cells at 0.5 and 0.9 with one
profile term changed (the extend floor halved, the eager term 0; DeepEP's term 0 and doubled, a
new_token_ratio of 0.21 and the prefill delayer's pass without a forward at 0.25 and 4 ms on the
16-rank trace-file cells at 0.9), seed 0, the rows the verdict compares. The PD cells run the
whole files, 8 prefill : 16 decode ranks. The held-out cells (``held-*``) are cells
``inflight_wave``'s defaults were not chosen on: 24 and 64 ranks, and the second 1,200 s of each
trace file.

Each cell is one JSON file written when it is done, so an interrupted sweep resumes where it
stopped; runs go one after another in this process (``nice`` it on a shared machine). A line per
finished cell goes to stdout; where stderr is a terminal, a progress bar there counts the cells and
the current cell's runs.

**The results data.** docs/results/*.json hold every measured table of docs/DISPATCH-RESULTS.md, one
file per section: each table's id, caption, columns, alignment and rows (cells as printed), and the
runs it came from (``source``). They were imported once (2026-12-03) from the tables docs/DISPATCH.md
then held: the per-cell output of those sweeps and comparisons was not kept, so those files carry the
figures as published (their ``imported`` key says so). ``collect`` condenses a sweep's cells into the
same format (``lockstep-sweep.json``), so a new sweep regenerates its table. In the markdown, a table
stands between ``<!-- results FILE ID -->`` and ``<!-- /results -->``; ``table`` rewrites those regions
from the data, and every table of the data has exactly one.

**The pictures.** Each study (a results file whose tables compare methods cell by cell) has one
picture, FILE.png beside FILE.json, linked in the markdown beside its tables: goodput against p99
TTFT for every method of every cell, p50 against p99 TTFT where the cells measured no goodput, and a
sweep's summary as each lockstep method's goodput and p99 TTFT over the best row's in every cell,
with the bar shaded. ``table`` redraws a picture whose data changed (each carries its data's digest,
which ``table --check`` compares without drawing); ``picture`` draws them again; both need
matplotlib (the ``plot`` extra). The same data and matplotlib give the same file.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import re
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))

from compare_methods import METRICS, seed_cell  # noqa: E402  (the same columns and cells as the example's)

from dpboard.sim.pd import make_simulation  # noqa: E402
from dpboard.sim.profile import Profile, load_profile  # noqa: E402
from dpboard.sim.report import Progress, summarize  # noqa: E402
from dpboard.sim.simulation import SimConfig  # noqa: E402
from dpboard.sim.trace import scenario_trace  # noqa: E402
from dpboard.sim.tracefile import read_trace_file, shape_trace  # noqa: E402

PROFILE = "deepseek-v3-dp-attention-h100"
TRACES = {"azure": "traces/azure2023_conv.csv", "mooncake": "traces/mooncake_conversation.jsonl"}
SCENARIOS = ("bursty", "longshort")
WINDOW = (0.0, 1200.0)
LOADS = (0.5, 0.75, 0.9)
RANKS = (8, 16, 32)
SEEDS = (0, 1, 2)
LOCKSTEP = "inflight_lockstep:cadence=step"
WAVE = "inflight_wave:cadence=step"
OURS = (LOCKSTEP, WAVE)  # the two methods for ranks in lockstep that the bar and auto choose between
# SGLang's delayer with its opt-in queue trigger (--prefill-delayer-queue-min-ratio; its max delay
# stays SGLang's 5,000 ms): SGLang's own bounded hold, run beside SGLang's methods. SGLang gives the
# ratio no default; a half of the running batch is the middle of its (0, 1] range
QUEUE_RATIO = 0.5
QUEUED_METHODS = ("round_robin", "total_requests:cadence=sglang", "total_tokens:cadence=sglang")
# cells nobody tuned inflight_wave's defaults on (they were chosen on azure, bursty and longshort at 16
# ranks, seed 0, loads 0.5-0.9): other rank counts and loads, and the second 1,200 s of each trace file
HELD_OUT = ((24, 0.6), (24, 0.85), (64, 0.7))
LATER_WINDOW = (1200.0, 2400.0)
METHODS = (
    "round_robin",
    "total_requests:cadence=sglang",
    "total_tokens:cadence=sglang",
    "vllm",
    "cache_aware",
    "dynamo_kv",
    "inflight_ttft:cadence=step",
    "inflight_cache:cadence=step",  # Mooncake only: elsewhere the same picks as inflight_backlog
    LOCKSTEP,
    WAVE,
)
SEEDED = ("vllm", "dynamo_kv")  # routers whose ties or servers are drawn from the seed
SENSITIVITY = {
    "floor-halved": lambda p: dataclasses.replace(p, rank=dataclasses.replace(p.rank, prefill_base_s=p.rank.prefill_base_s / 2)),
    "eager-0": lambda p: dataclasses.replace(p, lockstep=dataclasses.replace(p.lockstep, eager_decode_s=0.0)),
    "deepep-0": lambda p: dataclasses.replace(p, lockstep=dataclasses.replace(p.lockstep, extend_dispatch_s=0.0)),
    "deepep-2x": lambda p: dataclasses.replace(
        p, lockstep=dataclasses.replace(p.lockstep, extend_dispatch_s=2 * p.lockstep.extend_dispatch_s)),
    "ratio-0.21": lambda p: dataclasses.replace(p, rank=dataclasses.replace(p.rank, new_token_ratio=0.21)),
    # the prefill delayer's pass without a forward (the profile's idle_pass_ms, 1 ms): a quarter, four times
    "idle-pass-0.25ms": lambda p: dataclasses.replace(p, lockstep=dataclasses.replace(p.lockstep, idle_pass_s=0.25e-3)),
    "idle-pass-4ms": lambda p: dataclasses.replace(p, lockstep=dataclasses.replace(p.lockstep, idle_pass_s=4e-3)),
}
MAIN_SENSITIVITY = ("floor-halved", "eager-0")
PD_METHODS = (
    "follow_bootstrap_room/round_robin",
    "total_tokens:cadence=sglang",
    "dynamo_kv",
    "inflight_cache:cadence=step",
    "inflight_lockstep:cadence=step",
    "inflight_cache:cadence=step/inflight_lockstep:cadence=step",
)
# a sensitivity cell asks whether the order of the rows that matter changes: seed 0, those rows
SENSITIVITY_METHODS = ("round_robin", "total_requests:cadence=sglang", "total_tokens:cadence=sglang", "cache_aware",
                       "dynamo_kv", "inflight_ttft:cadence=step", "inflight_cache:cadence=step", LOCKSTEP, WAVE)


def cells() -> list[dict[str, Any]]:
    out = []
    for trace in (*TRACES, *SCENARIOS):
        for ranks in RANKS:
            for load in LOADS:
                out.append({"name": f"{trace}-{ranks}-{load:g}", "trace": trace, "ranks": ranks, "load": load})
    for variant in SENSITIVITY:
        # the two unpublished terms the verdict rests on, everywhere at 16 ranks; the others on one
        # cell of each trace file
        traces, loads = ((*TRACES, *SCENARIOS), (0.5, 0.9)) if variant in MAIN_SENSITIVITY else (TRACES, (0.9,))
        for trace in traces:
            for load in loads:
                out.append({"name": f"{variant}-{trace}-16-{load:g}", "trace": trace, "ranks": 16, "load": load,
                            "variant": variant})
    for trace in TRACES:
        out.append({"name": f"pd-{trace}-0.9", "trace": trace, "ranks": 24, "load": 0.9, "pd": (8, 16)})
    for trace in TRACES:
        for ranks, load in HELD_OUT:
            out.append({"name": f"held-{trace}-{ranks}-{load:g}", "trace": trace, "ranks": ranks, "load": load,
                        "held_out": True})
        out.append({"name": f"held-{trace}-later-16-0.75", "trace": trace, "ranks": 16, "load": 0.75,
                    "held_out": True, "window": LATER_WINDOW})
    return out


def _profile(cell: dict[str, Any]) -> Profile:
    profile = load_profile(PROFILE)
    variant = cell.get("variant")
    return SENSITIVITY[variant](profile) if variant else profile


def _trace(cell: dict[str, Any], seed: int, config: SimConfig, trace_files: dict[str, Any]):
    pd = cell.get("pd")
    if cell["trace"] in TRACES:
        name = cell["trace"]
        if name not in trace_files:
            trace_files[name] = read_trace_file(ROOT / TRACES[name])
        return shape_trace(trace_files[name], n_ranks=config.n_ranks, seed=seed, rank=config.rank,
                           window=(None, None) if pd else tuple(cell.get("window", WINDOW)), load=cell["load"], pd=pd,
                           lockstep=None if pd else config.lockstep)
    return scenario_trace(cell["trace"], config.n_ranks, seed, load=cell["load"], rank=config.rank,
                          lockstep=config.lockstep, pd=pd)


def _methods(cell: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(method, seeds) of a cell: all seeds where the seed changes that run, else seed 0."""
    if cell.get("pd"):
        methods = PD_METHODS
    else:
        methods = SENSITIVITY_METHODS if cell.get("variant") else METHODS
        methods = [m for m in methods if cell["trace"] == "mooncake" or not m.startswith("inflight_cache")]
    if cell.get("variant"):
        return [(m, (0,)) for m in methods]
    every = cell["trace"] != "azure"
    return [(m, SEEDS if every or m.split(":")[0] in SEEDED else (0,)) for m in methods]


def _runs(cell: dict[str, Any]) -> list[tuple[int, str, bool, float | None]]:
    """The runs of a cell in the order they are made: (seed, method, prefill delayer, queue ratio)."""
    delayers = (False,) if cell.get("pd") else (False, True)
    out = []
    for seed in SEEDS:
        for method, seeds in _methods(cell):
            if seed not in seeds:
                continue
            variants = [(d, None) for d in delayers]
            if not cell.get("pd") and method in QUEUED_METHODS:
                variants.append((True, QUEUE_RATIO))
            out += [(seed, method, delayer, ratio) for delayer, ratio in variants]
    return out


def run_cell(cell: dict[str, Any], trace_files: dict[str, Any],
             on_run: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every run of the cell (``on_run`` is told each one's label as it ends)."""
    profile = _profile(cell)
    pd = profile.pd(*cell["pd"]) if cell.get("pd") else None
    rank, _ = profile.run_rank(cell["ranks"], dp_attention=True, pd=pd is not None, chunk_given=False)
    base = SimConfig(n_ranks=cell["ranks"], rank=rank, lockstep=profile.lockstep, pd=pd,
                     slo_ttft_s=profile.slo_ttft_s, slo_tpot_s=profile.slo_tpot_s)
    runs: dict[str, list[dict[str, Any]]] = {}
    info: dict[str, Any] = {}
    wall0 = time.perf_counter()
    trace, trace_seed = None, None
    for seed, method, delayer, ratio in _runs(cell):
        if seed != trace_seed:
            trace, trace_seed = _trace(cell, seed, base, trace_files), seed
            info[str(seed)] = {k: v for k, v in trace.info.items() if isinstance(v, (int, float, str))}
        config = dataclasses.replace(base, prefill_delayer=delayer, prefill_delayer_queue_min_ratio=ratio)
        label = method + (" +delayer" if delayer else "") + (" +queue" if ratio else "")
        summary = summarize(make_simulation(trace, method, config).run())
        summary["seed"] = seed
        runs.setdefault(label, []).append(summary)
        if on_run is not None:
            on_run(f"{_short(label)}, seed {seed}")
    return {"cell": cell, "chunk": rank.chunked_prefill_size, "trace_info": info, "runs": runs,
            "wall_s": time.perf_counter() - wall0}


def run(args: argparse.Namespace) -> int:
    """The cells not yet in --out, one after another: a line per cell on stdout as each ends, and
    on a terminal a progress bar over the cells and the current cell's runs (stderr)."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    todo = [c for c in cells() if (not args.only or c["name"] in args.only.split(","))]
    todo = [c for c in todo if args.only or not (out / f"{c['name']}.json").exists()]
    trace_files: dict[str, Any] = {}
    with Progress(len(todo), "cells", lines=True) as progress:
        for cell in todo:
            path = out / f"{cell['name']}.json"
            progress.start(cell["name"], parts=len(_runs(cell)))
            t0 = time.perf_counter()
            doc = run_cell(cell, trace_files, on_run=progress.part)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc, indent=1))
            tmp.replace(path)
            progress.done(f"{cell['name']}: {time.perf_counter() - t0:.0f} s")
    return 0


# -- tables -------------------------------------------------------------------------------------------

_METRIC = {key: (label, key, fmt) for label, key, fmt in METRICS}
# goodput with one more decimal than the example's: the bar compares it to within 1 %
COLUMNS = (("goodput req/s", "goodput_rps", "{:.3f}"), ("met both SLOs", "goodput_share", "{:.1%}"),
           _METRIC["ttft_p99_ms"], _METRIC["ttft_p50_ms"],
           _METRIC["tpot_p99_ms"], ("p50 TPOT ms", "tpot_p50_ms", "{:.0f}"), _METRIC["idle_rank_step_share"],
           ("extend steps", "extend_step_share", "{:.1%}"), ("p99 held ms", "held_p99_ms", "{:.0f}"))
# the rows the bar compares the lockstep method with: SGLang's methods and the peers, without and
# with the prefill delayer (docs/DISPATCH-RESULTS.md, "Verdict in DP attention and PD")
SEED_AND_PEERS = ("round_robin", "total_requests:cadence=sglang", "total_tokens:cadence=sglang", "vllm",
                  "cache_aware", "dynamo_kv")
SHORT = {"total_requests:cadence=sglang": "total_requests", "total_tokens:cadence=sglang": "total_tokens",
         "inflight_ttft:cadence=step": "inflight_ttft", "inflight_cache:cadence=step": "inflight_cache",
         "inflight_lockstep:cadence=step": "inflight_lockstep", "inflight_wave:cadence=step": "inflight_wave"}


def _short(label: str) -> str:
    for long, short in SHORT.items():
        label = label.replace(long, short)
    return label


def _means(doc: dict[str, Any]) -> dict[str, dict[str, float]]:
    # a cell run before a column existed reads 0 there (held_p99_ms: nothing was held)
    return {label: {key: float(np.mean([r.get(key, 0.0) for r in runs])) for _, key, _ in COLUMNS}
            for label, runs in doc["runs"].items()}


def _cell_table(doc: dict[str, Any]) -> dict[str, Any]:
    """One cell's table (every method's mean over seeds [range]), the best goodput and p99 TTFT in bold."""
    means = _means(doc)
    best_g = max(v["goodput_rps"] for v in means.values())
    best_t = min(v["ttft_p99_ms"] for v in means.values())
    rows = []
    for label, runs in doc["runs"].items():
        cells = []
        for _, key, fmt in COLUMNS:
            text = seed_cell([r.get(key, 0.0) for r in runs], fmt)
            if (key == "goodput_rps" and means[label][key] == best_g) or (key == "ttft_p99_ms" and means[label][key] == best_t):
                text = f"**{text}**"
            cells.append(text)
        rows.append([_short(label), *cells])
    return {"columns": ["method", *(c[0] for c in COLUMNS)], "align": "l" + "r" * len(COLUMNS), "rows": rows}


SGLANG_METHODS = ("round_robin", "total_requests:cadence=sglang", "total_tokens:cadence=sglang")


# the bar: goodput at least this share of the best seed method or peer (with or without the delayer),
# p99 TTFT at most this multiple of the best other row
GOODPUT_BAR = 0.99
TTFT_BAR = 1.05


def meets(ratios: dict[str, float]) -> bool:
    """Both halves of the bar, from ``verdict``'s ratios of one variant."""
    return ratios["any"] >= GOODPUT_BAR and ratios["ttft"] <= TTFT_BAR


def verdict(doc: dict[str, Any], ours: str = LOCKSTEP) -> dict[str, Any]:
    """The lockstep method's goodput and p99 TTFT, without and with the delayer, against: the best
    seed method or peer without the delayer, the best of SGLang's own methods with it, the best seed
    method or peer with or without it (goodput); the best of every other row (p99 TTFT)."""
    means = _means(doc)

    def best(rows: dict[str, dict[str, float]], key: str, high: bool) -> tuple[str, float]:
        if not rows:
            return "", float("nan")
        label = (max if high else min)(rows, key=lambda k: rows[k][key])
        return _short(label), rows[label][key]

    plain = {k: v for k, v in means.items() if k in SEED_AND_PEERS}
    sglang_delayed = {k: v for k, v in means.items() if k.endswith(" +delayer") and k.split(" ")[0] in SGLANG_METHODS}
    anyone = {k: v for k, v in means.items() if k.split(" ")[0] in SEED_AND_PEERS}
    every = {k: v for k, v in means.items() if k.split(" ")[0] not in OURS}
    refs = {"plain": best(plain, "goodput_rps", True), "sglang_delayed": best(sglang_delayed, "goodput_rps", True),
            "any": best(anyone, "goodput_rps", True), "ttft": best(every, "ttft_p99_ms", False)}
    out: dict[str, Any] = {"refs": refs}
    for variant in (ours, ours + " +delayer"):
        if variant in means:
            mine = means[variant]
            out[variant] = {name: (mine["ttft_p99_ms"] if name == "ttft" else mine["goodput_rps"]) / value
                            if value and value == value else float("nan") for name, (_, value) in refs.items()}
    return out


def _cell_heading(name: str, doc: dict[str, Any]) -> str:
    cell = doc["cell"]
    info = doc["trace_info"].get("0", {})
    trace = {"azure": "Azure conversation", "mooncake": "Mooncake conversation"}.get(cell["trace"], f"`{cell['trace']}`")
    variant = f", {cell['variant']}" if cell.get("variant") else ""
    if cell.get("pd"):
        return f"**PD {cell['pd'][0]}:{cell['pd'][1]}, {trace}, load {cell['load']:g}** (the whole file)"
    independent = info.get("independent_load")
    also = f", {independent:.2f} of an independent rank's" if isinstance(independent, float) else ""
    return (f"**{trace}, {cell['ranks']} ranks, load {cell['load']:g}{variant}** (chunk {doc['chunk']}{also}; "
            f"{doc['wall_s']:.0f} s of CPU)")


VERDICT_COLUMNS = ["cell", "goodput / best seed or peer", "/ best SGLang + delayer", "/ best of both",
                   "p99 TTFT / best row", "with the delayer: goodput / best of both", "p99 TTFT / best row", "bar met",
                   "best goodput (seed or peer, either)", "best p99 TTFT"]


def _mark(x: float, bound: float, higher: bool) -> str:
    ok = x >= bound if higher else x <= bound
    return f"{x:.2f}" if ok else f"**{x:.2f}**"


def verdict_table(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The summary table: per cell, ``inflight_lockstep`` against the references of the bar."""
    rows = []
    for name in [c["name"] for c in cells() if c["name"] in docs]:
        v = verdict(docs[name])
        if LOCKSTEP not in v:
            continue
        off, on, refs = v[LOCKSTEP], v.get(LOCKSTEP + " +delayer"), v["refs"]
        row = [name, _mark(off["plain"], GOODPUT_BAR, True),
               _mark(off["sglang_delayed"], GOODPUT_BAR, True) if refs["sglang_delayed"][0] else "—",
               _mark(off["any"], GOODPUT_BAR, True), _mark(off["ttft"], TTFT_BAR, False)]
        row += [_mark(on["any"], GOODPUT_BAR, True), _mark(on["ttft"], TTFT_BAR, False)] if on else ["—", "—"]
        met = [name for name, v in (("without", off), ("with", on)) if v and meets(v)]
        verdict_text = " and ".join(met) + " the delayer" if met else "no"
        # PD has a bar of its own (no loss to inflight_cache), read from the goodput column
        row += ["—" if docs[name]["cell"].get("pd") else verdict_text, refs["any"][0], refs["ttft"][0]]
        rows.append(row)
    return {"columns": VERDICT_COLUMNS, "align": "l" + "r" * 6 + "lll", "rows": rows}


# per lockstep method: its goodput / the best row's, its p99 TTFT / the best row's
BAR_VARIANTS = (LOCKSTEP, LOCKSTEP + " +delayer", WAVE, WAVE + " +delayer")
BAR_COLUMNS = ["cell", "tuned on", *(f"{_short(m)}: goodput, p99 TTFT / best" for m in BAR_VARIANTS),
               "met both SLOs: lockstep, wave, best goodput row", "wave's p99 held ms", "bar met by", "best goodput",
               "best p99 TTFT"]
# the cells inflight_wave's defaults were chosen on
TUNED = (("azure", 16), ("bursty", 16), ("longshort", 16))


def bar(doc: dict[str, Any]) -> dict[str, Any]:
    """The bar for each lockstep method without the delayer: goodput against the best row of the cell
    (any method, with or without the delayer, either of ours included), p99 TTFT against the best
    row; and every row that meets both against those bests."""
    means = _means(doc)
    best_g = max(means, key=lambda k: means[k]["goodput_rps"])
    best_t = min(means, key=lambda k: means[k]["ttft_p99_ms"])
    g, t = means[best_g]["goodput_rps"], means[best_t]["ttft_p99_ms"]
    ratios = {label: (v["goodput_rps"] / g if g else float("nan"), v["ttft_p99_ms"] / t if t else float("nan"))
              for label, v in means.items()}
    met = [label for label, (rg, rt) in ratios.items() if rg >= GOODPUT_BAR and rt <= TTFT_BAR]
    return {"means": means, "ratios": ratios, "met": met, "best_goodput": best_g, "best_ttft": best_t}


def bar_table(docs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per cell: both lockstep methods against the best rows, and which rows meet the bar there."""
    rows = []
    for name in [c["name"] for c in cells() if c["name"] in docs]:
        doc = docs[name]
        if doc["cell"].get("pd") or not all(m in doc["runs"] for m in OURS):
            continue
        b = bar(doc)
        cell = doc["cell"]
        tuned = (cell["trace"], cell["ranks"]) in TUNED and not cell.get("held_out") and not cell.get("variant")
        row = [name, "yes" if tuned else "no"]
        for m in BAR_VARIANTS:
            rg, rt = b["ratios"].get(m, (float("nan"), float("nan")))
            row.append(f"{_mark(rg, GOODPUT_BAR, True)}, {_mark(rt, TTFT_BAR, False)}")
        share = [b["means"][m]["goodput_share"] for m in OURS] + [b["means"][b["best_goodput"]]["goodput_share"]]
        row += [" / ".join(f"{x:.1%}" for x in share), f"{b['means'][WAVE]['held_p99_ms']:.0f}",
                ", ".join(_short(m) for m in b["met"]) or "no row", _short(b["best_goodput"]), _short(b["best_ttft"])]
        rows.append(row)
    return {"columns": BAR_COLUMNS, "align": "ll" + "r" * 6 + "lll", "rows": rows}


def _sweep(out: Path) -> dict[str, dict[str, Any]]:
    docs = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    if not docs:
        raise SystemExit(f"lockstep_sweep: no cells in {out} (run them first: lockstep_sweep.py run --out {out})")
    return docs


def print_sweep(args: argparse.Namespace) -> int:
    """A sweep's tables from its cells: with --cells every cell's, then the verdict."""
    docs = _sweep(Path(args.out))
    for name in [c["name"] for c in cells() if c["name"] in docs] if args.cells else ():
        doc = docs[name]
        fold = args.fold and (doc["cell"]["ranks"] != 16 or doc["cell"].get("variant"))
        if fold:
            print(f"\n<details><summary>{_cell_heading(name, doc).replace('**', '')}</summary>\n")
        else:
            print(f"\n{_cell_heading(name, doc)}:\n")
        print("\n".join(render_table(_cell_table(doc))))
        if fold:
            print("\n</details>")
    print()
    print("\n".join(render_table(verdict_table(docs))))
    print()
    print("\n".join(render_table(bar_table(docs))))
    return 0


def collect(args: argparse.Namespace) -> int:
    """The sweep's cells condensed into the results data (its verdict table)."""
    docs = _sweep(Path(args.out))
    table = {"id": "verdict", "caption": "inflight_lockstep against the best rows of each cell, without and with "
             "the delayer", **verdict_table(docs)}
    waves = {"id": "wave-bar", "caption": "inflight_lockstep and inflight_wave against the best row of each cell",
             **bar_table(docs)}
    results = {"section": args.section,
               "source": f"python tools/lockstep_sweep.py run --out {args.out}: {len(docs)} cells, "
                         f"{sum(d['wall_s'] for d in docs.values()):.0f} s of CPU",
               "collected": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "tables": [table, waves]}
    write_results(Path(args.results), results)
    print(f"{args.results}: {len(table['rows'])} rows from {len(docs)} cells; "
          f"`lockstep_sweep.py table` renders them into {DOC.relative_to(ROOT)}")
    return 0


# -- the results data and the markdown rendered from it -------------------------------------------------

RESULTS = ROOT / "docs" / "results"
DOC = ROOT / "docs" / "DISPATCH-RESULTS.md"
REGION = re.compile(r"^<!-- results (\S+) (\S+) -->\n.*?^<!-- /results -->$", re.M | re.S)
ALIGN = {"l": "---", "r": "---:", "c": ":---:"}


def write_results(path: Path, doc: dict[str, Any]) -> None:
    """A results file: JSON, one table row a line (so that a diff names the rows that changed)."""
    text = json.dumps(doc, indent=1, ensure_ascii=False)
    rows = re.compile(r'\[\n\s*((?:"(?:[^"\\]|\\.)*",?\s*)*)\]')
    path.write_text(rows.sub(lambda m: json.dumps(json.loads(m.group(0)), ensure_ascii=False), text) + "\n")


def render_table(table: dict[str, Any]) -> list[str]:
    """A table as markdown lines: its heading line (where it has one), the header, the rows."""
    def row(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|"

    lines = [table["heading"], ""] if table.get("heading") else []
    lines += [row(table["columns"]), "|" + "|".join(ALIGN[a] for a in table["align"]) + "|"]
    return lines + [row(r) for r in table["rows"]]


def render(text: str, results: dict[str, dict[str, Any]]) -> str:
    """The markdown with every marked region rendered from the data; a marker naming no table, a
    table marked twice or a table of the data marked nowhere is an error."""
    tables = {(name, t["id"]): t for name, doc in results.items() for t in doc["tables"]}
    seen: set[tuple[str, str]] = set()

    def region(m: re.Match) -> str:
        key = (m.group(1), m.group(2))
        if key not in tables:
            raise SystemExit(f"lockstep_sweep: {DOC.name} marks {key[0]} {key[1]}, which docs/results does not hold")
        if key in seen:
            raise SystemExit(f"lockstep_sweep: {DOC.name} marks {key[0]} {key[1]} twice")
        seen.add(key)
        return "\n".join([f"<!-- results {key[0]} {key[1]} -->", "", *render_table(tables[key]), "",
                          "<!-- /results -->"])

    out = REGION.sub(region, text)
    if set(tables) - seen:
        raise SystemExit(f"lockstep_sweep: tables of docs/results marked nowhere in {DOC.name}: "
                         + ", ".join(f"{f} {i}" for f, i in sorted(set(tables) - seen)))
    return out


# -- the pictures drawn from the data ------------------------------------------------------------------
#
# A study, a results file whose tables compare methods cell by cell, has one picture, FILE.png beside
# it in docs/results, drawn from those tables alone and linked in the markdown beside them: goodput
# against p99 TTFT for every method of every cell (p50 against p99 TTFT where the cells have no
# goodput); the sweeps' summaries as each lockstep method's ratios to the best row of every cell, the
# bar shaded. A picture carries the digest of the data it was drawn from in a PNG text chunk, so that
# `table --check` needs no matplotlib to say whether it is current; `table` redraws the stale ones
# and `picture` redraws them all. Drawn the same way every time: matplotlib's default style whatever
# the machine's matplotlibrc, no date or version of the software in the file.

PICTURE_STYLE = "1"  # raise it when the drawing changes: every picture then reads as stale
PICTURE_DPI = 80
TRACE_NAMES = ("azure", "mooncake", "bursty", "longshort")
BAR_SUFFIX = ": goodput, p99 TTFT / best"
PICTURE_TITLES = {
    "goodput": "goodput against p99 TTFT, every method in every cell (mean of the seeds; bars: their range)",
    "ttft": "p50 against p99 TTFT, every method in every cell (no goodput measured; mean of the seeds, bars: "
            "their range)",
    "verdict": "inflight_lockstep, without and with the delayer, against the best rows of every cell (shaded: "
               "the bar)",
    "bar": "each lockstep method against the best row of every cell (shaded: the bar, goodput ≥ 0.99× and p99 "
           "TTFT ≤ 1.05×)",
}
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _picture_kind(table: dict[str, Any]) -> str | None:
    columns = table["columns"]
    if any(c.endswith(BAR_SUFFIX) for c in columns):
        return "bar"
    if columns == VERDICT_COLUMNS:
        return "verdict"
    if columns[0] == "method" and "p99 TTFT ms" in columns:
        if "goodput req/s" in columns:
            return "goodput"
        return "ttft" if "p50 TTFT ms" in columns else None
    return None


def study(doc: dict[str, Any]) -> tuple[str, list[dict[str, Any]]] | None:
    """What a results file's picture is drawn from, (kind, tables); None for a file that has none."""
    kinds: dict[str, list[dict[str, Any]]] = {}
    for t in doc["tables"]:
        kind = _picture_kind(t)
        if kind:
            kinds.setdefault(kind, []).append(t)
    # a sweep's bar table holds both lockstep methods, its verdict table one
    kind = next((k for k in ("bar", "verdict", "goodput", "ttft") if k in kinds), None)
    return (kind, kinds[kind][:1] if kind in ("bar", "verdict") else kinds[kind]) if kind else None


def picture_name(results_name: str) -> str:
    return f"{Path(results_name).stem}.png"


def picture_digest(kind: str, tables: list[dict[str, Any]]) -> str:
    text = json.dumps({"style": PICTURE_STYLE, "kind": kind, "tables": tables}, sort_keys=True, ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


def png_text(path: Path) -> dict[str, str]:
    """The text chunks of a PNG file; empty for a missing file or one that is no PNG."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return {}
    if not data.startswith(PNG_SIGNATURE):
        return {}
    out, at = {}, len(PNG_SIGNATURE)
    while at + 8 <= len(data):
        size, kind = struct.unpack(">I4s", data[at:at + 8])
        if kind == b"tEXt":
            key, _, value = data[at + 8:at + 8 + size].partition(b"\0")
            out[key.decode("latin-1")] = value.decode("latin-1")
        elif kind == b"IEND":
            break
        at += 12 + size  # length, type, data, CRC
    return out


def stale_pictures(results: dict[str, dict[str, Any]], folder: Path) -> list[str]:
    """The results files whose picture in ``folder`` is missing or was drawn from other data."""
    return [name for name, doc in results.items()
            if (s := study(doc)) and png_text(folder / picture_name(name)).get("Data") != picture_digest(*s)]


def unlinked_pictures(text: str, results: dict[str, dict[str, Any]]) -> list[str]:
    return [picture_name(name) for name, doc in results.items()
            if study(doc) and f"](results/{picture_name(name)})" not in text]


def _figure(cell: str) -> tuple[float, float, float] | None:
    """(mean, low, high) of a table cell ('**1.542**', '1815 [1782–1863]', '6.5%'); None where it has none."""
    found = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", cell.replace(",", ""))]
    if not found:
        return None
    return (found[0], found[1], found[2]) if len(found) == 3 else (found[0], found[0], found[0])


def _method(cell: str) -> str:
    return re.sub(r"\s*\(.*$", "", cell).replace("`", "").strip()


def _family_marker(method: str) -> str:
    """dpboard's methods round, the peers' routers square, SGLang's own triangles."""
    if "inflight_" in method or method == "vllm_board":
        return "o"
    if method.split(":")[0] in ("vllm", "cache_aware", "dynamo_kv"):
        return "s"
    return "^"


def _log_axis(axis: Any, subs: tuple[float, ...] = (1.0, 2.0, 5.0)) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=subs))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def _panel_title(table: dict[str, Any]) -> str:
    title = re.split(r" \(|, seeds|, the same", table["caption"])[0]
    if title.startswith("Load"):  # the cells of one trace: 'Load 0.6' under its table id 'azure-0.6'
        title = f"{table['id'].rsplit('-', 1)[0]}, l{title[1:]}"
    return title.replace("`", "")


def _method_figure(kind: str, tables: list[dict[str, Any]], figure: Any) -> Any:
    from matplotlib import colormaps
    from matplotlib.lines import Line2D

    methods = list(dict.fromkeys(_method(row[0]) for t in tables for row in t["rows"]))
    palette = colormaps["tab20"]
    # the dark half of tab20 first, then the light: neighbours in the list differ most
    colours = {m: palette((2 * i) % 20 + (2 * i) // 20 % 2) for i, m in enumerate(methods)}
    n = len(tables)
    ncols = n if n <= 4 else (3 if n % 3 == 0 else 4)
    nrows = -(-n // ncols)
    fig = figure(figsize=(3.7 * ncols + 3.2, 3.1 * nrows + 0.7), layout="constrained")
    axes = fig.subplots(nrows, ncols, squeeze=False).ravel()
    y_column, y_label = ("goodput req/s", "goodput req/s") if kind == "goodput" else ("p50 TTFT ms", "p50 TTFT ms (log)")
    for ax, table in zip(axes, tables, strict=False):
        xi, yi = table["columns"].index("p99 TTFT ms"), table["columns"].index(y_column)
        for row in table["rows"]:
            method, x, y = _method(row[0]), _figure(row[xi]), _figure(row[yi])
            if x is None or y is None:
                continue
            ax.errorbar([x[0]], [y[0]], xerr=[[x[0] - x[1]], [x[2] - x[0]]], yerr=[[y[0] - y[1]], [y[2] - y[0]]],
                        color=colours[method], marker=_family_marker(method), markersize=6, linestyle="none",
                        elinewidth=0.8, alpha=0.9)
        ax.set_xscale("log")
        _log_axis(ax.xaxis)
        if kind == "ttft":
            ax.set_yscale("log")
            _log_axis(ax.yaxis)
        ax.set_title(_panel_title(table), fontsize=9)
        ax.set_xlabel("p99 TTFT ms (log)", fontsize=8)
        ax.set_ylabel(y_label, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(True, which="both", alpha=0.25)
        better = "better: up and left" if kind == "goodput" else "better: down and left"
        ax.text(0.98, 0.02 if kind == "goodput" else 0.98, better, transform=ax.transAxes, ha="right",
                va="bottom" if kind == "goodput" else "top", fontsize=7, color="0.4")
    for ax in axes[n:]:
        ax.set_visible(False)
    handles = [Line2D([], [], color=colours[m], marker=_family_marker(m), linestyle="none", label=m) for m in methods]
    fig.legend(handles=handles, loc="outside right center", fontsize=8, title="method", title_fontsize=8)
    return fig


def _cell_kind(name: str) -> str:
    if name.startswith("pd-"):
        return "PD cell"
    if name.startswith("held-"):
        return "held-out cell"
    if any(name.startswith(f"{v}-") for v in SENSITIVITY):
        return "sensitivity cell"
    return "cell"


CELL_MARKERS = {"cell": "o", "sensitivity cell": "s", "held-out cell": "D", "PD cell": "P"}


def _ratio_points(kind: str, table: dict[str, Any]) -> list[tuple[str, str, float, float]]:
    """(cell, variant, p99 TTFT / best, goodput / best) of every variant of every cell that has both."""
    columns, out = table["columns"], []
    if kind == "bar":
        variants = [(c[:-len(BAR_SUFFIX)], i, None) for i, c in enumerate(columns) if c.endswith(BAR_SUFFIX)]
    else:  # the verdict's "/ best of both" and "p99 TTFT / best row", without and with the delayer
        variants = [(LOCKSTEP.split(":")[0], 3, 4), (LOCKSTEP.split(":")[0] + " +delayer", 5, 6)]
    for row in table["rows"]:
        for variant, gi, ti in variants:
            g, t = (row[gi].split(", ") + [""])[:2] if ti is None else (row[gi], row[ti])
            g, t = _figure(g), _figure(t)
            if g is not None and t is not None:
                out.append((row[0], variant, t[0], g[0]))
    return out


def _ratio_figure(kind: str, table: dict[str, Any], figure: Any) -> Any:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    points = _ratio_points(kind, table)
    variants = list(dict.fromkeys(p[1] for p in points))
    colours = {v: f"C{i}" for i, v in enumerate(variants)}
    traces = [t for t in TRACE_NAMES if any(t in p[0].split("-") for p in points)]
    xs, ys = [p[2] for p in points], [p[3] for p in points]
    xlim = (min(0.9, min(xs) / 1.05), max(1.2, max(xs) * 1.1))
    ylim = (min(0.5, min(ys) / 1.2), max(1.5, max(ys) * 1.2))
    fig = figure(figsize=(2 * 4.6 + 2.8, 2 * 3.8 + 0.7), layout="constrained")
    axes = fig.subplots(2, 2, sharex=True, sharey=True, squeeze=False).ravel()
    for ax, trace in zip(axes, traces, strict=False):
        mine = [p for p in points if trace in p[0].split("-")]
        ax.add_patch(Rectangle((xlim[0], GOODPUT_BAR), TTFT_BAR - xlim[0], ylim[1] - GOODPUT_BAR, color="0.88", zorder=0,
                               linewidth=0))
        ax.axvline(TTFT_BAR, color="0.6", linewidth=0.8, linestyle=":", zorder=0)
        ax.axhline(GOODPUT_BAR, color="0.6", linewidth=0.8, linestyle=":", zorder=0)
        for cell, variant, x, y in mine:
            ax.plot([x], [y], color=colours[variant], marker=CELL_MARKERS[_cell_kind(cell)], markersize=5,
                    linestyle="none", alpha=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        _log_axis(ax.xaxis, subs=(1.0, 1.25, 1.5, 2.0, 3.0, 5.0))
        _log_axis(ax.yaxis)
        ax.set_xlim(*xlim)
        ax.set_ylim(*ylim)
        ax.set_title(f"{trace} ({len({p[0] for p in mine})} cells)", fontsize=9)
        ax.set_xlabel("p99 TTFT / the best row's (log)", fontsize=8)
        ax.set_ylabel("goodput / the best row's (log)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.tick_params(labelbottom=True, labelleft=True)
        ax.grid(True, which="both", alpha=0.25)
    for ax in axes[len(traces):]:
        ax.set_visible(False)
    kinds = [k for k in CELL_MARKERS if any(_cell_kind(p[0]) == k for p in points)]
    handles = [Line2D([], [], color=colours[v], marker="o", linestyle="none", label=v) for v in variants]
    handles += [Line2D([], [], color="0.3", marker=CELL_MARKERS[k], linestyle="none", label=k) for k in kinds]
    fig.legend(handles=handles, loc="outside right center", fontsize=8)
    return fig


def draw_picture(name: str, doc: dict[str, Any], folder: Path) -> Path:
    """The picture of the study ``name`` (a results file's name), written to ``folder``."""
    s = study(doc)
    if s is None:
        raise SystemExit(f"lockstep_sweep: {name} holds no table a picture is drawn from")
    kind, tables = s
    try:
        import matplotlib
        from matplotlib.figure import Figure
    except ImportError as e:
        raise SystemExit(f"lockstep_sweep: drawing {picture_name(name)} needs matplotlib ({e}): "
                         "pip install -e '.[plot]' (or matplotlib)") from e
    path = folder / picture_name(name)
    with matplotlib.rc_context():
        matplotlib.rcdefaults()  # the same picture whatever the machine's matplotlibrc says
        fig = _method_figure(kind, tables, Figure) if kind in ("goodput", "ttft") else _ratio_figure(kind, tables[0], Figure)
        fig.suptitle(f"docs/results/{name}\n{PICTURE_TITLES[kind]}", fontsize=10)
        # no Software chunk (matplotlib's version) and no date: the file is the data's and the drawing's
        fig.savefig(path, dpi=PICTURE_DPI, metadata={
            "Software": None, "Title": f"docs/results/{name}", "Source": "tools/lockstep_sweep.py picture",
            "Data": picture_digest(kind, tables), "Renderer": f"matplotlib {matplotlib.__version__}"})
    return path


def _results(folder: Path) -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def table(args: argparse.Namespace) -> int:
    """Render the markdown's tables from the data and redraw the stale pictures; with --check, only
    say where the markdown or a picture differs from the data."""
    if args.out:
        return print_sweep(args)
    doc, folder = Path(args.doc), Path(args.results)
    results = _results(folder)
    text = doc.read_text()
    rendered = render(text, results)
    stale = stale_pictures(results, folder)
    unlinked = unlinked_pictures(rendered, results)
    if unlinked:
        print(f"{doc}: pictures linked nowhere: {', '.join(unlinked)} (link each beside its tables as "
              f"![...](results/NAME.png))", file=sys.stderr)
    if args.check:
        if rendered != text:
            now = {m.group(1, 2): m.group(0) for m in REGION.finditer(text)}
            differ = [f"{f} {i}" for m in REGION.finditer(rendered) for f, i in [m.group(1, 2)] if now[f, i] != m.group(0)]
            print(f"{doc}: tables that differ from {args.results}: {', '.join(differ)}; "
                  f"`python tools/lockstep_sweep.py table` rewrites them", file=sys.stderr)
        if stale:
            print(f"{args.results}: pictures not drawn from their data as it is: "
                  f"{', '.join(picture_name(n) for n in stale)}; `python tools/lockstep_sweep.py table` redraws them",
                  file=sys.stderr)
        if rendered != text or stale or unlinked:
            return 1
        print(f"{doc}: every table as {args.results} holds it, every picture drawn from it")
        return 0
    if rendered != text:
        doc.write_text(rendered)
    drawn = [draw_picture(name, results[name], folder).name for name in stale]
    print(f"{doc}: {len(REGION.findall(rendered))} tables from {args.results}"
          + (f"; pictures redrawn: {', '.join(drawn)}" if drawn else ""))
    return 1 if unlinked else 0


def picture(args: argparse.Namespace) -> int:
    """Draw the pictures of the studies in --results (all, or those --only names), stale or not."""
    folder = Path(args.results)
    results = _results(folder)
    names = [n for n, d in results.items() if study(d)]
    if args.only:
        wanted = [n if n.endswith(".json") else f"{n}.json" for n in args.only.split(",")]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise SystemExit(f"lockstep_sweep: no study {', '.join(unknown)} in {folder} (studies: {', '.join(names)})")
        names = wanted
    for name in names:
        print(draw_picture(name, results[name], folder))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="run the cells not yet in --out (default out/lockstep)")
    r.add_argument("--out", default="out/lockstep")
    r.add_argument("--only", help="comma-separated cell names (rerun even when present)")
    c = sub.add_parser("collect", help="condense the cells of --out into the results data (lockstep-sweep.json)")
    c.add_argument("--out", default="out/lockstep")
    c.add_argument("--results", default=str(RESULTS / "lockstep-sweep.json"), help="the file it writes")
    c.add_argument("--section", default="DP attention: the second pass, measured",
                   help="the section of the results markdown its tables stand in")
    t = sub.add_parser("table", help="render the results markdown's tables from the data and redraw the pictures "
                                     "drawn from other data (with --out: print a sweep's verdict table, and with "
                                     "--cells every cell's table)")
    t.add_argument("--check", action="store_true", help="rewrite and draw nothing: exit 1 where the markdown or "
                                                        "a picture differs from the data")
    t.add_argument("--doc", default=str(DOC), help="the markdown whose tables are rendered")
    t.add_argument("--results", default=str(RESULTS), help="the folder of results data (and of the pictures)")
    t.add_argument("--out", help="a sweep's folder of cells: print its tables instead")
    t.add_argument("--cells", action="store_true", help="with --out: every cell's table too")
    t.add_argument("--fold", action="store_true", help="with --cells: the cells other than 16 ranks in <details>")
    g = sub.add_parser("picture", help="draw every study's picture from the results data (FILE.png beside FILE.json)")
    g.add_argument("--results", default=str(RESULTS), help="the folder of results data and pictures")
    g.add_argument("--only", help="comma-separated results files (azure.json or azure): only their pictures")
    args = p.parse_args(argv)
    return {"run": run, "collect": collect, "table": table, "picture": picture}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
