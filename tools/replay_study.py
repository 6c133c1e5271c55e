"""Real-server truth for dispatch: a window of a real trace replayed through a real SGLang server,
one server per method, and the same window through ``dpboard sim`` with a profile fitted from that
server's own recorded steps (docs/REPLAY.md says what was found).

The server is ``sglang.launch_server --dp-size 2`` on the CPU with the tiny model
(tests/support/sglang_serving.py), ``--sleep-on-idle`` (idle schedulers do not spin), its DP
controller reniced (its loop spins a core even when idle). SGLang's own methods run without dpboard
(``SGLANG_PLUGINS=none``: SGLang loads every installed plugin otherwise); dpboard's through the plugin
(``DPBOARD_METHOD``), with the step recorder on (``DPBOARD_STEP_LOG``), whose logs fit the profile.

The traffic: ``WINDOW`` requests of the Azure conversation trace from ``WINDOW_START`` s on, each
prompt and output length times ``LENGTH_SCALE`` (one factor, so that the window fits the tiny
model's KV), outputs capped at ``MAX_OUTPUT``; prompts are random token ids (the same ids in every
arm), ``ignore_eos``, streamed ``/generate``. The arrival times are the trace's, scaled so that the
window offers a stated share of the server's capacity, which ``capacity`` measures first (the window
sent at once, requests per second until the last one ends).

The client is dpboard's own (asyncio, aiohttp from SGLang's environment), not
``sglang.benchmark.serving``: its Mooncake replay builds text prompts from hash ids and ignores the
trace's lengths, and it takes the first token from the first chunk with text, which a tiny model's
ids without visible text delay. Here the first token is the first chunk whose ``completion_tokens``
is at least 1.

Each cell (arm, load, repeat) is written to the results file as it ends, and a rerun skips the cells
there: a study stopped halfway resumes. Arms alternate within a repeat, so a slow spell of the
machine falls on every arm alike.

    .venv-sglang/bin/python tools/replay_study.py capacity      # the server's requests/s on the window
    .venv-sglang/bin/python tools/replay_study.py run [--loads light] [--repeats 3]
    .venv-sglang/bin/python tools/replay_study.py sim           # calibrate, then the window in dpboard sim
    .venv-sglang/bin/python tools/replay_study.py report        # docs/REPLAY.md's table and picture

``make replay-study`` runs all four (about 30 s of start-up and 2-4 minutes of traffic per cell).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpboard.sim.tracefile import read_trace_file  # noqa: E402

TRACE = Path(os.environ.get("DPBOARD_TRACES") or ROOT.parent / "shared" / "traces") / "azure2023_conv.csv"
RESULTS = ROOT / "docs" / "replay" / "results.json"
WINDOW_START = 600.0  # seconds into the trace: past its first minutes
WINDOW = 360  # requests
LENGTH_SCALE = 0.25
MAX_OUTPUT = 128
VOCAB = (3, 1000)  # the tiny model's token ids, specials left out
SEED = 0
LOADS = {"light": 0.275, "heavy": 0.6}  # shares of the measured capacity
# (arm, who dispatches, method)
ARMS = (
    ("round_robin", "sglang", "round_robin"),
    ("total_requests", "sglang", "total_requests"),
    ("total_tokens", "sglang", "total_tokens"),
    ("inflight_tokens", "dpboard", "inflight_tokens"),
    ("inflight_ttft", "dpboard", "inflight_ttft"),
    ("inflight_backlog", "dpboard", "inflight_backlog"),
)
SERVER_FLAGS = ("--sleep-on-idle",)
REQUEST_TIMEOUT = 600.0  # seconds a request may take; past it the cell fails (a bound, not a figure)
STEP_LOGS = ROOT / ".replay-study" / "steps"
RECORD_LOGS = STEP_LOGS / "record"
PROFILE = ROOT / "docs" / "replay" / "cpu.profile"


def window() -> list[dict[str, Any]]:
    """The window's requests: offset from the first (s, the trace's own timing), prompt and output tokens."""
    tf = read_trace_file(TRACE)
    index = np.flatnonzero(tf.arrival_s >= WINDOW_START)[:WINDOW]
    if index.size < WINDOW:
        raise SystemExit(f"{TRACE} has {index.size} requests after {WINDOW_START} s, the study takes {WINDOW}")
    t0 = float(tf.arrival_s[index[0]])
    out = []
    for i in index:
        prompt = max(1, round(int(tf.prompt_len[i]) * LENGTH_SCALE))
        output = min(MAX_OUTPUT, max(1, round(int(tf.output_len[i]) * LENGTH_SCALE)))
        out.append({"offset_s": float(tf.arrival_s[i]) - t0, "prompt": prompt, "output": output})
    return out


def prompt_ids(index: int, length: int) -> list[int]:
    return np.random.default_rng([SEED, index]).integers(*VOCAB, size=length).tolist()


def load_results(path: Path) -> dict[str, Any]:
    if path.exists():
        return json.loads(path.read_text())
    return {"cells": {}}


def save_results(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)  # a cell is written whole or not at all


# ---- the client ----

async def _one(session: Any, url: str, index: int, req: dict[str, Any], t0: float, at: float) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + at - loop.time()))
    sent = loop.time()
    body = {"input_ids": prompt_ids(index, req["prompt"]), "stream": True,
            "sampling_params": {"max_new_tokens": req["output"], "ignore_eos": True, "temperature": 0.0}}
    first = None
    tokens = 0
    rank = None
    async with session.post(url + "/generate", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"request {index}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            meta = json.loads(payload).get("meta_info", {})
            tokens = int(meta.get("completion_tokens", tokens))
            rank = meta.get("dp_rank", rank)
            if first is None and tokens >= 1:
                first = loop.time()
    end = loop.time()
    if tokens != req["output"] or first is None:
        raise RuntimeError(f"request {index}: {tokens} tokens of {req['output']}")
    return {"i": index, "arrival": at, "late_ms": (sent - t0 - at) * 1e3, "ttft": first - sent, "e2e": end - sent,
            "tokens": tokens, "rank": rank}


async def replay(url: str, reqs: list[dict[str, Any]], times: list[float]) -> list[dict[str, Any]]:
    import aiohttp  # SGLang's environment has it

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = asyncio.get_running_loop().time() + 0.5
        return await asyncio.gather(*(_one(session, url, i, r, t0, at) for i, (r, at) in enumerate(zip(reqs, times, strict=True))))


def figures(records: list[dict[str, Any]]) -> dict[str, Any]:
    """TTFT and TPOT percentiles, throughput and the ranks' shares of one run."""
    ttft = np.array([r["ttft"] for r in records])
    tpot = np.array([(r["e2e"] - r["ttft"]) / (r["tokens"] - 1) for r in records if r["tokens"] > 1])
    start = min(r["arrival"] for r in records)
    end = max(r["arrival"] + r["late_ms"] / 1e3 + r["e2e"] for r in records)
    ranks = [r["rank"] for r in records if r["rank"] is not None]
    return {
        "requests": len(records),
        "ttft_p50_ms": float(np.percentile(ttft, 50)) * 1e3, "ttft_p99_ms": float(np.percentile(ttft, 99)) * 1e3,
        "tpot_p50_ms": float(np.percentile(tpot, 50)) * 1e3, "tpot_p99_ms": float(np.percentile(tpot, 99)) * 1e3,
        "output_tokens_per_s": sum(r["tokens"] for r in records) / (end - start),
        "requests_per_s": len(records) / (end - start),
        "rank0_share": (sum(1 for r in ranks if r == 0) / len(ranks)) if ranks else None,
        "send_late_p99_ms": float(np.percentile([r["late_ms"] for r in records], 99)),
    }


# ---- the server ----

def start_server(arm: tuple[str, str, str], step_log: Path | None):
    from tests.support.names import new_board_name
    from tests.support.sglang_serving import Server

    name, who, method = arm
    if who == "sglang":
        env = {"SGLANG_PLUGINS": "none"}
        extra = ("--load-balance-method", method, *SERVER_FLAGS)
    else:
        env = {"SGLANG_PLUGINS": "dpboard", "DPBOARD_BOARD": new_board_name(), "DPBOARD_METHOD": method}
        if step_log is not None:
            step_log.mkdir(parents=True, exist_ok=True)
            env["DPBOARD_STEP_LOG"] = str(step_log)
        extra = ("--load-balance-method", "total_tokens", *SERVER_FLAGS)
    server = Server(env, extra=extra)
    try:
        server.wait_ready()
        for pid in server.titled("sglang::data_parallel_controller"):
            os.setpriority(os.PRIO_PROCESS, pid, 10)
    except BaseException:
        server.kill()
        raise
    return server


def run_cell(arm: tuple[str, str, str], reqs: list[dict[str, Any]], times: list[float], step_log: Path | None) -> dict[str, Any]:
    server = start_server(arm, step_log)
    try:
        warm = [{"offset_s": 0.0, "prompt": 64, "output": 8}] * 4  # the first requests pay one-off costs
        asyncio.run(replay(server.url, warm, [0.0] * len(warm)))
        began = time.time()
        records = asyncio.run(replay(server.url, reqs, times))
        return {"figures": figures(records), "records": records, "wall_s": time.time() - began}
    finally:
        server.stop()
        server.kill()


def arrival_times(reqs: list[dict[str, Any]], rate: float) -> list[float]:
    """The trace's own offsets scaled so that the window's mean rate is ``rate`` requests/s."""
    span = reqs[-1]["offset_s"]
    natural = (len(reqs) - 1) / span
    return [r["offset_s"] * natural / rate for r in reqs]


def cmd_capacity(args: argparse.Namespace) -> None:
    doc = load_results(args.results)
    if "capacity" in doc:
        print(f"capacity: {doc['capacity']['requests_per_s']:.3f} requests/s, measured {doc['capacity']['when']} "
              f"(remove it from {args.results} to measure again)")
        return
    reqs = window()
    arm = next(a for a in ARMS if a[0] == "total_tokens")
    result = run_cell(arm, reqs, [0.0] * len(reqs), None)
    doc["capacity"] = {"requests_per_s": result["figures"]["requests_per_s"], "arm": arm[0],
                       "figures": result["figures"], "when": time.strftime("%Y-%m-%d %H:%M")}
    save_results(args.results, doc)
    print(f"capacity: {doc['capacity']['requests_per_s']:.3f} requests/s on {len(reqs)} requests sent at once")


def cmd_run(args: argparse.Namespace) -> None:
    doc = load_results(args.results)
    if "capacity" not in doc:
        raise SystemExit(f"no capacity in {args.results}: run `{Path(__file__).name} capacity` first")
    reqs = window()
    doc["setup"] = {"trace": TRACE.name, "window_start_s": WINDOW_START, "requests": WINDOW,
                    "length_scale": LENGTH_SCALE, "max_output": MAX_OUTPUT, "server_flags": list(SERVER_FLAGS),
                    "machine": f"{platform.machine()}, {os.cpu_count()} cores", "python": platform.python_version()}
    arms = [a for a in ARMS if not args.arms or a[0] in args.arms]
    for load in args.loads:
        rate = LOADS[load] * doc["capacity"]["requests_per_s"]
        times = arrival_times(reqs, rate)
        for repeat in range(args.repeats):
            order = arms if repeat % 2 == 0 else arms[::-1]  # alternate: drift falls on every arm alike
            for arm in order:
                key = f"{arm[0]}|{load}|{repeat}"
                if key in doc["cells"]:
                    continue
                step_log = STEP_LOGS / key.replace("|", "-") if arm[1] == "dpboard" else None
                print(f"{time.strftime('%H:%M:%S')} {key}: {len(reqs)} requests at {rate:.3f}/s", flush=True)
                load_before = os.getloadavg()[0]
                result = run_cell(arm, reqs, times, step_log)
                result.update(loadavg=[load_before, os.getloadavg()[0]], arm=arm[0], who=arm[1], load=load, share=LOADS[load], rate=rate, repeat=repeat,
                              step_log=str(step_log.relative_to(ROOT)) if step_log else None,
                              when=time.strftime("%Y-%m-%d %H:%M"))
                doc["cells"][key] = result
                save_results(args.results, doc)
                f = result["figures"]
                print(f"  TTFT p50 {f['ttft_p50_ms']:.0f} ms p99 {f['ttft_p99_ms']:.0f} ms, TPOT p50 "
                      f"{f['tpot_p50_ms']:.1f} ms, {f['requests_per_s']:.3f} req/s, {result['wall_s']:.0f} s", flush=True)


def cmd_record(args: argparse.Namespace) -> None:
    """One server with the step recorder and dpboard's inflight_tokens, the window sent at the two
    loads and then at once: steps of every batch shape the study's cells run, for the fit."""
    doc = load_results(args.results)
    if "capacity" not in doc:
        raise SystemExit(f"no capacity in {args.results}: run `{Path(__file__).name} capacity` first")
    if RECORD_LOGS.exists() and any(RECORD_LOGS.iterdir()):
        print(f"{RECORD_LOGS} holds step logs already: remove it to record again")
        return
    reqs = window()
    arm = ("record", "dpboard", "inflight_tokens")
    server = start_server(arm, RECORD_LOGS)
    try:
        for load, share in LOADS.items():
            asyncio.run(replay(server.url, reqs, arrival_times(reqs, share * doc["capacity"]["requests_per_s"])))
            print(f"recorded the window at {load} load", flush=True)
        asyncio.run(replay(server.url, reqs, [0.0] * len(reqs)))
    finally:
        server.stop()
        server.kill()
    doc["record"] = {"arm": "inflight_tokens", "loads": [*LOADS, "at once"], "logs": str(RECORD_LOGS.relative_to(ROOT)),
                     "when": time.strftime("%Y-%m-%d %H:%M")}
    save_results(args.results, doc)


def cmd_sim(args: argparse.Namespace) -> None:
    """Fit the profile from the recorded steps, then every arm and load of the study in dpboard sim."""
    from dpboard.sim.calibrate import fit_profile, table_from_logs
    from dpboard.sim.profile import load_profile_file
    from dpboard.sim.report import summarize
    from dpboard.sim.simulation import SimConfig, Simulation
    from dpboard.sim.trace import Trace
    from dpboard.steplog.reader import read_step_log, step_log_paths

    doc = load_results(args.results)
    logs = [read_step_log(p) for p in step_log_paths(RECORD_LOGS)]
    table, settings = table_from_logs(logs)
    fit = fit_profile(table, settings)
    PROFILE.write_text(fit.profile_text("replay-study-cpu", f"the step logs of `{Path(__file__).name} record`"))
    print(fit.report())
    profile = load_profile_file(PROFILE)
    doc["fit"] = {"terms": {t.key: t.value for t in fit.terms}, "error": fit.error, "loose": fit.loose,
                  "steps": fit.steps, "used": fit.used, "settings": settings,
                  "profile": str(PROFILE.relative_to(ROOT))}
    reqs = window()
    prompt = np.array([r["prompt"] for r in reqs], dtype=np.int64)
    output = np.array([r["output"] for r in reqs], dtype=np.int64)
    doc["sim"] = {}
    for load, share in LOADS.items():
        times = np.array(arrival_times(reqs, share * doc["capacity"]["requests_per_s"]))
        trace = Trace(name=f"{TRACE.name} window", n_ranks=2, seed=SEED, arrival_s=times, prompt_len=prompt,
                      output_len=output, is_burst=np.zeros(len(reqs), bool))
        for name, _, method in ARMS:
            config = SimConfig(n_ranks=2, rank=profile.rank, overlap_schedule=bool(settings.get("overlap")),
                               slo_ttft_s=profile.slo_ttft_s, slo_tpot_s=profile.slo_tpot_s).validate()
            result = Simulation(trace, method, config).run()
            s = summarize(result)
            span = float(s["makespan_s"] - times.min())
            doc["sim"][f"{name}|{load}"] = {
                "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"], "tpot_p50_ms": s["tpot_p50_ms"],
                "tpot_p99_ms": s["tpot_p99_ms"], "output_tokens_per_s": float(output.sum()) / span,
                "requests_per_s": len(reqs) / span,
                "rank0_share": sum(1 for r in result.requests if r.rank == 0) / len(result.requests)}
    save_results(args.results, doc)


METRICS = (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
           ("tpot_p99_ms", "TPOT p99 ms"), ("output_tokens_per_s", "output tok/s"))
WITHIN = 0.15  # the simulator's bar on p50s at light load: within 15 % of the real median, or its spread
DOC = ROOT / "docs" / "REPLAY.md"
PICTURE = ROOT / "docs" / "replay" / "sim-vs-real.png"


def real_cells(doc: dict[str, Any], arm: str, load: str) -> list[dict[str, Any]]:
    return [c["figures"] for c in doc["cells"].values() if c["arm"] == arm and c["load"] == load]


def compare(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per load, arm and figure: the real median, spread (min, max) and repeats, the simulated value,
    its error against the median and whether it is within the bar."""
    rows = []
    for load in LOADS:
        for arm, _, _ in ARMS:
            real = real_cells(doc, arm, load)
            sim = doc.get("sim", {}).get(f"{arm}|{load}")
            if not real:
                continue
            for key, label in (*METRICS, ("rank0_share", "rank 0 share")):
                values = [f[key] for f in real if f.get(key) is not None]
                if not values:
                    continue
                median = statistics.median(values)
                row = {"load": load, "arm": arm, "key": key, "label": label, "median": median, "min": min(values),
                       "max": max(values), "repeats": len(values), "sim": None, "error": None, "within": None}
                if sim is not None and sim.get(key) is not None:
                    row["sim"] = sim[key]
                    row["error"] = (sim[key] - median) / median if median else None
                    in_spread = min(values) <= sim[key] <= max(values)
                    row["within"] = bool(in_spread or (row["error"] is not None and abs(row["error"]) <= WITHIN))
                rows.append(row)
    return rows


def ranking(doc: dict[str, Any], load: str, key: str, source: str) -> list[str]:
    """The arms from best to worst by ``key`` (lower is better), real medians or simulated values."""
    values = {}
    for arm, _, _ in ARMS:
        if source == "real":
            real = [f[key] for f in real_cells(doc, arm, load)]
            if real:
                values[arm] = statistics.median(real)
        elif f"{arm}|{load}" in doc.get("sim", {}):
            values[arm] = doc["sim"][f"{arm}|{load}"][key]
    return sorted(values, key=values.__getitem__)


def inseparable(doc: dict[str, Any], load: str, key: str) -> list[tuple[str, str]]:
    """Pairs of arms whose real repeats overlap on ``key``: the noise cannot order them."""
    spans = {arm: (min(v), max(v)) for arm, _, _ in ARMS if (v := [f[key] for f in real_cells(doc, arm, load)])}
    names = list(spans)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if spans[a][0] <= spans[b][1] and spans[b][0] <= spans[a][1]]


def render(doc: dict[str, Any]) -> str:
    rows = compare(doc)
    out = []
    cap = doc["capacity"]
    setup = doc.get("setup", {})
    out.append(f"Capacity of the server on the window: {cap['requests_per_s']:.2f} requests/s (the {WINDOW} requests "
               f"sent at once, {cap['when']}); {setup.get('machine', '')}.")
    if "fit" in doc:
        fit = doc["fit"]
        terms = ", ".join(f"{k} {v:.4g}" for k, v in fit["terms"].items())
        errors = "; ".join(f"{kind} {med:.1f} % / {p90:.1f} %" for kind, (med, p90) in fit["error"].items())
        out.append(f"\nFitted profile ({fit['profile']}, {fit['used'].get('extend', 0)} prefill and "
                   f"{fit['used'].get('decode', 0)} decode steps): {terms}. Fit error per step, median / p90: "
                   f"{errors}. Not pinned down: {', '.join(fit['loose']) or 'none'}.")
    for load, share in LOADS.items():
        mine = [r for r in rows if r["load"] == load]
        if not mine:
            continue
        out.append(f"\n**{load.capitalize()} load** ({share:.0%} of capacity, "
                   f"{share * cap['requests_per_s']:.2f} requests/s; real: median [min-max] of "
                   f"{max(r['repeats'] for r in mine)} repeats)\n")
        out.append("| method | " + " | ".join(label for _, label in (*METRICS, ("", "rank 0 share"))) + " |")
        out.append("|---" * (len(METRICS) + 2) + "|")
        for arm, _, _ in ARMS:
            cells = {r["key"]: r for r in mine if r["arm"] == arm}
            if not cells:
                continue
            row = [arm]
            for key, _ in (*METRICS, ("rank0_share", "")):
                r = cells.get(key)
                if r is None:
                    row.append("")
                    continue
                digits = 2 if key == "rank0_share" else (1 if r["median"] < 100 else 0)
                text = f"{r['median']:.{digits}f} [{r['min']:.{digits}f}-{r['max']:.{digits}f}]"
                if r["sim"] is not None:
                    mark = "" if r["within"] else " ✗"
                    text += f"<br>sim {r['sim']:.{digits}f} ({r['error']:+.0%}){mark}"
                row.append(text)
            out.append("| " + " | ".join(row) + " |")
        for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
            real = ranking(doc, load, key, "real")
            sim = ranking(doc, load, key, "sim")
            tied = inseparable(doc, load, key)
            line = f"\nRanking by {label}, real: {' < '.join(real)}"
            if tied:
                line += f" (the noise cannot separate {len(tied)} of {len(real) * (len(real) - 1) // 2} pairs)"
            if sim:
                line += f"; simulated: {' < '.join(sim)}"
            out.append(line + ".")
    return "\n".join(out) + "\n"


def picture(doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in compare(doc) if r["sim"] is not None]
    keys = [k for k, _ in METRICS[:4]]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4))
    for ax, key in zip(axes, keys, strict=True):
        mine = [r for r in rows if r["key"] == key]
        for load, marker in zip(LOADS, "os", strict=False):
            pts = [r for r in mine if r["load"] == load]
            if not pts:
                continue
            med = np.array([r["median"] for r in pts])
            err = np.array([[r["median"] - r["min"] for r in pts], [r["max"] - r["median"] for r in pts]])
            ax.errorbar(med, [r["sim"] for r in pts], xerr=err, fmt=marker, label=f"{load} load", capsize=2)
            for r in pts:
                ax.annotate(r["arm"].replace("inflight_", "i_"), (r["median"], r["sim"]), fontsize=6)
        lo = min([r["min"] for r in mine] + [r["sim"] for r in mine]) * 0.8
        hi = max([r["max"] for r in mine] + [r["sim"] for r in mine]) * 1.2
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(dict(METRICS)[key])
        ax.set_xlabel("real (median, bar: min-max)")
        ax.set_ylabel("simulated")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(PICTURE, dpi=110)


def cmd_report(args: argparse.Namespace) -> None:
    doc = load_results(args.results)
    text = render(doc)
    marker_open, marker_close = "<!-- replay -->", "<!-- /replay -->"
    page = DOC.read_text()
    head, _, rest = page.partition(marker_open)
    _, _, tail = rest.partition(marker_close)
    DOC.write_text(f"{head}{marker_open}\n{text}{marker_close}{tail}")
    if doc.get("sim"):
        picture(doc)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--results", type=Path, default=RESULTS)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("capacity")
    sub.add_parser("record")
    sub.add_parser("sim")
    sub.add_parser("report")
    run = sub.add_parser("run")
    run.add_argument("--loads", nargs="+", choices=list(LOADS), default=list(LOADS))
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--arms", nargs="*", choices=[a[0] for a in ARMS])
    args = parser.parse_args()
    {"capacity": cmd_capacity, "run": cmd_run, "record": cmd_record, "sim": cmd_sim, "report": cmd_report}[args.command](args)


if __name__ == "__main__":
    main()
