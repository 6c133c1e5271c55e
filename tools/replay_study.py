"""Real-server truth for dispatch: a window of a real trace replayed through a real SGLang server,
one server per method, and the same window through ``dpboard sim`` with a profile fitted from that
server's own recorded steps (docs/REPLAY.md says what was found).

Two setups (``--setup``): ``independent``, ``sglang.launch_server --dp-size 2`` on the CPU with the
tiny model (tests/support/sglang_serving.py), and ``dp-attention``, the same with
``--enable-dp-attention --tp-size 2`` (the ranks step in lockstep; the tiny model as a Qwen3). Each
has its arms (methods), loads, results file, fitted profile and section of docs/REPLAY.md.
``--sleep-on-idle`` (idle schedulers do not spin), the DP controller reniced (its loop spins a core
even when idle). SGLang's own methods run without dpboard (``SGLANG_PLUGINS=none``: SGLang loads
every installed plugin otherwise); dpboard's through the plugin (``DPBOARD_METHOD``), with the step
recorder on (``DPBOARD_STEP_LOG``).

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

The simulator's profile: ``record`` runs one server with the recorder through the window at every
load and at once (the step log's batch shapes span the cells'), then sends ``PROBES`` lone requests
to the idle server; ``sim`` fits the rank model to the steps (``dpboard calibrate``'s fit) and the
front end (``frontend_ms``: what a lone request's TTFT exceeds the fitted model's by) to the probes.

Each cell (arm, load, repeat) is written to the results file as it ends, and a rerun skips the cells
there: a study stopped halfway resumes. Arms alternate within a repeat, so a slow spell of the
machine falls on every arm alike.

    .venv-sglang/bin/python tools/replay_study.py [--setup dp-attention] capacity  # requests/s on the window
    .venv-sglang/bin/python tools/replay_study.py [--setup ...] run [--loads light] [--repeats 3]
    .venv-sglang/bin/python tools/replay_study.py [--setup ...] record   # step log and lone requests
    .venv-sglang/bin/python tools/replay_study.py [--setup ...] sim      # fit, then the window in dpboard sim
    .venv-sglang/bin/python tools/replay_study.py [--setup ...] report   # docs/REPLAY.md's table and picture

``make replay-study`` runs all five for both setups (about 30 s of start-up and 10-60 s of traffic
per cell; docs/REPLAY.md says how long in all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dpboard.sim.tracefile import read_trace_file  # noqa: E402

TRACES = Path(os.environ.get("DPBOARD_TRACES") or ROOT.parent / "shared" / "traces")
TRACE = TRACES / "azure2023_conv.csv"
MOONCAKE = TRACES / "mooncake_conversation.jsonl"
# Mooncake's prompts (p50 6,909 tokens) against the tiny model's 2,048-token context: each prompt's
# first 3 blocks of 512 tokens, as the trace has them, so that equal blocks are equal prefixes still
# (real prefix reuse) and the simulator's 512-token blocks are the server's
MOONCAKE_BLOCKS = 3
BLOCK_TOKENS = 512
WINDOW_START = 600.0  # seconds into the trace: past its first minutes
WINDOW = 360  # requests
LENGTH_SCALE = 0.25
MAX_OUTPUT = 128
VOCAB = (3, 1000)  # the tiny model's token ids, specials left out
SEED = 0
SERVER_FLAGS = ("--sleep-on-idle",)
REQUEST_TIMEOUT = 600.0  # seconds a request may take; past it the cell fails (a bound, not a figure)
PROBES = 40  # lone requests sent to the idle server for the front-end fit
DOC = ROOT / "docs" / "REPLAY.md"


@dataclass(frozen=True)
class Arm:
    """One dispatch method as a server runs it: ``who`` dispatches (SGLang alone, without dpboard, or
    dpboard's plugin), with ``flags`` more on the server's command line; ``delayer``: SGLang's
    prefill delayer is on (the simulator runs it too)."""

    name: str
    who: str
    method: str
    flags: tuple[str, ...] = ()
    delayer: bool = False


@dataclass(frozen=True)
class Setup:
    """A server's shape and the arms run on it, each with its own results, profile and page section."""

    name: str
    dp_attention: bool
    arms: tuple[Arm, ...]
    loads: dict[str, float]  # shares of the measured capacity
    results: Path
    profile: Path
    picture: Path
    engine: str = "sglang"
    trace: str = "azure"  # or "mooncake"
    profile_of: str | None = None  # run the simulator with that setup's fitted profile (the same server)
    frontend_of: str | None = None  # take that setup's front end (the same path outside the schedulers)
    # the recording also sends these setups' windows at their light load (setups that take this one's
    # profile: their prompts' lengths and contexts must be among the steps the profile is fitted on)
    record_also: tuple[str, ...] = ()

    @property
    def step_logs(self) -> Path:
        return ROOT / ".replay-study" / self.name / "steps"

    @property
    def record_logs(self) -> Path:
        return self.step_logs / "record"

    @property
    def marker(self) -> str:
        return "replay" if self.name == "independent" else f"replay {self.name}"

    def arm(self, name: str) -> Arm:
        return next(a for a in self.arms if a.name == name)


SETUPS = {s.name: s for s in (
    Setup("independent", False, (
        Arm("round_robin", "sglang", "round_robin"),
        Arm("total_requests", "sglang", "total_requests"),
        Arm("total_tokens", "sglang", "total_tokens"),
        Arm("inflight_tokens", "dpboard", "inflight_tokens"),
        Arm("inflight_ttft", "dpboard", "inflight_ttft"),
        Arm("inflight_backlog", "dpboard", "inflight_backlog"),
    ), {"light": 0.275, "heavy": 0.6, "heavier": 0.85}, ROOT / "docs" / "replay" / "results.json",
        ROOT / "docs" / "replay" / "cpu.profile", ROOT / "docs" / "replay" / "sim-vs-real.png",
        record_also=("mooncake",)),
    # DP attention (--enable-dp-attention --tp-size 2, the tiny model as a Qwen3): the ranks step in
    # lockstep. SGLang's default method is round_robin; its prefill delayer holds a rank's prefill
    # until the group prefills together.
    Setup("dp-attention", True, (
        Arm("round_robin", "sglang", "round_robin"),
        Arm("round_robin+delayer", "sglang", "round_robin", ("--enable-prefill-delayer",), delayer=True),
        Arm("inflight_lockstep", "dpboard", "inflight_lockstep"),
        Arm("inflight_wave", "dpboard", "inflight_wave"),
    ), {"light": 0.275, "heavy": 0.6}, ROOT / "docs" / "replay" / "dp-attention.json",
        ROOT / "docs" / "replay" / "cpu-dp-attention.profile", ROOT / "docs" / "replay" / "sim-vs-real-dp-attention.png",
        # a lone request on an idle DP-attention group waits for the group to wake (about 200 ms
        # here): not the front end, which is the independent setup's code path
        frontend_of="independent"),
    # Mooncake's conversation trace on the independent ranks: prompts that share prefixes (36.6 % of its
    # blocks repeat an earlier one), so the radix cache and a cache-aware method have something to do;
    # the simulator runs it with the independent setup's profile (the same server), blocks and all.
    # The light load alone: its cells take twice the Azure window's time (longer prompts, a lower
    # capacity), and the bar the study sets is at that load.
    Setup("mooncake", False, (
        Arm("round_robin", "sglang", "round_robin"),
        Arm("total_tokens", "sglang", "total_tokens"),
        Arm("inflight_tokens", "dpboard", "inflight_tokens"),
        Arm("inflight_cache", "dpboard", "inflight_cache"),
    ), {"light": 0.275}, ROOT / "docs" / "replay" / "mooncake.json",
        ROOT / "docs" / "replay" / "cpu.profile", ROOT / "docs" / "replay" / "sim-vs-real-mooncake.png",
        trace="mooncake", profile_of="independent"),
    # vllm serve --data-parallel-size 2 (vLLM's CPU build): its own balancing (the plugin installed,
    # no DPBOARD_ setting: it patches nothing) against the plugin's picks. One server per arm, every
    # cell of the arm on it (a vLLM start takes minutes here), so each cell's prompts are its own
    # (vLLM's prefix cache would serve a repeat of a prompt). The simulator runs vLLM's balancing as
    # its `vllm` peer policy; its rank model is SGLang's scheduler (prefill and decode steps apart),
    # fitted to vLLM's pure steps, while vLLM mixes prefill chunks into decode steps.
    Setup("vllm", False, (
        Arm("vllm", "vllm", "vllm"),
        Arm("inflight_tokens", "dpboard", "inflight_tokens"),
        Arm("inflight_ttft", "dpboard", "inflight_ttft"),
    ), {"light": 0.275, "heavy": 0.6, "heavier": 0.85}, ROOT / "docs" / "replay" / "vllm.json",
        ROOT / "docs" / "replay" / "cpu-vllm.profile", ROOT / "docs" / "replay" / "sim-vs-real-vllm.png", engine="vllm"),
)}


def window(setup: Setup | None = None) -> list[dict[str, Any]]:
    """The window's requests: offset from the first (s, the trace's own timing), prompt and output
    tokens (and, from Mooncake, the prompt's block ids)."""
    if setup is not None and setup.trace == "mooncake":
        return mooncake_window()
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


def mooncake_window() -> list[dict[str, Any]]:
    """``WINDOW`` requests of the Mooncake trace from ``WINDOW_START`` s on (its 3-second buckets
    spread, seeded, as ``dpboard sim`` spreads them), each prompt its first ``MOONCAKE_BLOCKS``
    blocks, outputs times ``LENGTH_SCALE``, capped at ``MAX_OUTPUT``."""
    from dpboard.sim.tracefile import spread_buckets

    tf = read_trace_file(MOONCAKE)
    arrival = spread_buckets(tf.arrival_s, np.random.default_rng(SEED))
    order = np.argsort(arrival, kind="stable")
    index = order[arrival[order] >= WINDOW_START][:WINDOW]
    if index.size < WINDOW or tf.blocks is None:
        raise SystemExit(f"{MOONCAKE} has {index.size} requests with blocks after {WINDOW_START} s, the study takes {WINDOW}")
    rows = tf.blocks.rows()
    t0 = float(arrival[index[0]])
    out = []
    for i in index:
        blocks = list(rows[i][:MOONCAKE_BLOCKS])
        prompt = min(int(tf.prompt_len[i]), BLOCK_TOKENS * len(blocks))
        output = min(MAX_OUTPUT, max(1, round(int(tf.output_len[i]) * LENGTH_SCALE)))
        out.append({"offset_s": float(arrival[i]) - t0, "prompt": prompt, "output": output, "blocks": blocks})
    return out


def prompt_ids(index: int, length: int, salt: int = 0, blocks: list[int] | None = None) -> list[int]:
    """Request ``index``'s prompt; ``salt`` 0 in every SGLang cell (a fresh server each), the cell's
    own on a server that serves several cells (vLLM). With ``blocks``, the prompt is its blocks'
    tokens, each block's the same in every request that has it (a shared prefix)."""
    if blocks:
        ids = [t for b in blocks for t in np.random.default_rng([SEED, 7, b, salt]).integers(*VOCAB, size=BLOCK_TOKENS).tolist()]
        return ids[:length]
    return np.random.default_rng([SEED, index, salt] if salt else [SEED, index]).integers(*VOCAB, size=length).tolist()


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

# what SGLang's meta_info carries per request with --enable-metrics (wall-clock seconds, and the
# scheduler's queueing time): the HTTP server's receipt, the tokenizer's dispatch, the forward
# batch's entry and the prefill's end
TIME_STATS = ("request_received_ts", "api_server_dispatch_finish_ts", "forward_entry_time", "prefill_finished_time",
              "queue_time")


async def _one(session: Any, url: str, index: int, req: dict[str, Any], t0: float, at: float,
               engine: str = "sglang", salt: int = 0) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    await asyncio.sleep(max(0.0, t0 + at - loop.time()))
    sent = loop.time()
    sent_wall = time.time()  # SGLang's request time stats (--enable-metrics) are wall-clock stamps
    ids = prompt_ids(index, req["prompt"], salt, req.get("blocks"))
    if engine == "sglang":
        path = "/generate"
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": req["output"], "ignore_eos": True, "temperature": 0.0}}
    else:  # vLLM's OpenAI completions; its usage on every chunk counts the tokens (the text may be empty)
        path = "/v1/completions"
        body = {"model": "tiny", "prompt": ids, "max_tokens": req["output"], "ignore_eos": True, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    first = None
    tokens = 0
    rank = None
    cached = None
    stamps: dict[str, float] = {}
    first_wall = None
    async with session.post(url + path, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"request {index}: HTTP {resp.status}: {(await resp.text())[:300]}")
        async for line in resp.content:
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                break
            chunk = json.loads(payload)
            if engine == "sglang":
                meta = chunk.get("meta_info", {})
                tokens = int(meta.get("completion_tokens", tokens))
                rank = meta.get("dp_rank", rank)
                cached = meta.get("cached_tokens", cached)  # prompt tokens the radix cache held
                stamps.update((k, float(meta[k])) for k in TIME_STATS if meta.get(k) is not None)
            elif chunk.get("usage"):
                tokens = int(chunk["usage"].get("completion_tokens", tokens))
            if first is None and tokens >= 1:
                first = loop.time()
                first_wall = time.time()
    end = loop.time()
    if tokens != req["output"] or first is None:
        raise RuntimeError(f"request {index}: {tokens} tokens of {req['output']}")
    return {"i": index, "arrival": at, "late_ms": (sent - t0 - at) * 1e3, "ttft": first - sent, "e2e": end - sent,
            "tokens": tokens, "rank": rank, "prompt": req["prompt"], "cached": cached,
            **({"stamps": {**stamps, "sent": sent_wall, "first": first_wall}} if stamps else {})}


async def replay(url: str, reqs: list[dict[str, Any]], times: list[float], first_index: int = 0,
                 engine: str = "sglang", salt: int = 0) -> list[dict[str, Any]]:
    import aiohttp  # SGLang's environment has it

    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT)
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        t0 = asyncio.get_running_loop().time() + 0.5
        return await asyncio.gather(*(_one(session, url, first_index + i, r, t0, at, engine, salt)
                                      for i, (r, at) in enumerate(zip(reqs, times, strict=True))))


def idle_split(arrival: np.ndarray, end: np.ndarray, ttft: np.ndarray) -> dict[str, Any]:
    """The requests that arrived to an idle server (every earlier arrival had ended) apart from the
    rest: how many, and the TTFT p50 of each part (ms; None for an empty part)."""
    order = np.argsort(arrival, kind="stable")
    arrival, end, ttft = arrival[order], end[order], ttft[order]
    ended_before = np.concatenate([[-np.inf], np.maximum.accumulate(end)[:-1]])
    idle = ended_before <= arrival
    return {"idle": int(idle.sum()),
            "idle_ttft_p50_ms": float(np.median(ttft[idle])) * 1e3 if idle.any() else None,
            "busy_ttft_p50_ms": float(np.median(ttft[~idle])) * 1e3 if (~idle).any() else None}


def record_idle_split(records: list[dict[str, Any]]) -> dict[str, Any]:
    """``idle_split`` of a real run's records (the client's clock: sent at arrival + late, ended e2e later)."""
    arrival = np.array([r["arrival"] + r["late_ms"] / 1e3 for r in records])
    return idle_split(arrival, arrival + np.array([r["e2e"] for r in records]), np.array([r["ttft"] for r in records]))


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
        "cache_hit_rate": (sum(r["cached"] for r in records) / sum(r["prompt"] for r in records)
                           if all(r.get("cached") is not None for r in records) else None),
        "send_late_p99_ms": float(np.percentile([r["late_ms"] for r in records], 99)),
    }


# ---- the server ----

def start_server(setup: Setup, arm: Arm, step_log: Path | None):
    from tests.support.names import new_board_name
    from tests.support.session_server import ready_server
    from tests.support.sglang_serving import Server

    if arm.who == "sglang":
        env = {"SGLANG_PLUGINS": "none"}
        extra = ("--load-balance-method", arm.method, *arm.flags, *SERVER_FLAGS)
    else:
        env = {"SGLANG_PLUGINS": "dpboard", "DPBOARD_BOARD": new_board_name(), "DPBOARD_METHOD": arm.method}
        if step_log is not None:
            step_log.mkdir(parents=True, exist_ok=True)
            env["DPBOARD_STEP_LOG"] = str(step_log)
        extra = ("--load-balance-method", "total_tokens", *arm.flags, *SERVER_FLAGS)  # the plugin needs a load-aware one
    server = ready_server(lambda: Server(env, extra=extra, dp_attention=setup.dp_attention))
    try:
        for pid in server.titled("sglang::data_parallel_controller"):
            os.setpriority(os.PRIO_PROCESS, pid, 10)
    except BaseException:
        server.kill()
        raise
    return server


WARM = [{"offset_s": 0.0, "prompt": 64, "output": 8}] * 4  # the first requests pay one-off costs


def run_cell(setup: Setup, arm: Arm, reqs: list[dict[str, Any]], times: list[float], step_log: Path | None) -> dict[str, Any]:
    server = start_server(setup, arm, step_log)
    try:
        asyncio.run(replay(server.url, WARM, [0.0] * len(WARM)))
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


def cmd_capacity(setup: Setup, args: argparse.Namespace) -> None:
    if setup.engine == "vllm":
        print("vllm: `run` measures the capacity on its first server (a vLLM start takes minutes)")
        return
    doc = load_results(setup.results)
    if "capacity" in doc:
        print(f"capacity: {doc['capacity']['requests_per_s']:.3f} requests/s, measured {doc['capacity']['when']} "
              f"(remove it from {setup.results} to measure again)")
        return
    reqs = window(setup)
    arm = setup.arms[0]
    result = run_cell(setup, arm, reqs, [0.0] * len(reqs), None)
    doc["capacity"] = {"requests_per_s": result["figures"]["requests_per_s"], "arm": arm.name,
                       "figures": result["figures"], "when": time.strftime("%Y-%m-%d %H:%M")}
    save_results(setup.results, doc)
    print(f"capacity: {doc['capacity']['requests_per_s']:.3f} requests/s on {len(reqs)} requests sent at once")


def start_vllm(arm: Arm, step_log: Path | None = None):
    from tests.support.names import new_board_name
    from tests.support.session_server import ready_server
    from tests.support.vllm_serving import Server

    env = {} if arm.who == "vllm" else {"VLLM_PLUGINS": "dpboard", "DPBOARD_VLLM_BOARD": new_board_name(),
                                        "DPBOARD_METHOD": arm.method}
    if step_log is not None:
        step_log.mkdir(parents=True, exist_ok=True)
        env["DPBOARD_STEP_LOG"] = str(step_log)
    return ready_server(lambda: Server(env, extra=arm.flags))


def setup_info(setup: Setup) -> dict[str, Any]:
    """What the results file says of the study's setup."""
    info = {"trace": TRACE.name, "window_start_s": WINDOW_START, "requests": WINDOW, "length_scale": LENGTH_SCALE,
            "max_output": MAX_OUTPUT, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "python": platform.python_version()}
    if setup.engine == "vllm":
        return {**info, "engine": "vllm"}
    return {**info, "server_flags": list(SERVER_FLAGS), "dp_attention": setup.dp_attention}


def chosen_loads(setup: Setup, args: argparse.Namespace) -> list[str]:
    """``--loads``, each one of the setup's (default: all of them)."""
    for load in args.loads or ():
        if load not in setup.loads:
            raise SystemExit(f"--loads {load}: the {setup.name} setup runs {', '.join(setup.loads)}")
    return args.loads or list(setup.loads)


def keep_cell(setup: Setup, doc: dict[str, Any], result: dict[str, Any], arm: Arm, load: str, repeat: int,
              rate: float, load_before: float, step_log: Path | None) -> None:
    """One cell's result, with what it ran under, written to the results file at once, and its line."""
    result.update(loadavg=[load_before, os.getloadavg()[0]], arm=arm.name, who=arm.who, load=load,
                  share=setup.loads[load], rate=rate, repeat=repeat,
                  step_log=str(step_log.relative_to(ROOT)) if step_log else None, when=time.strftime("%Y-%m-%d %H:%M"))
    doc["cells"][f"{arm.name}|{load}|{repeat}"] = result
    save_results(setup.results, doc)
    f = result["figures"]
    print(f"  TTFT p50 {f['ttft_p50_ms']:.0f} ms p99 {f['ttft_p99_ms']:.0f} ms, TPOT p50 "
          f"{f['tpot_p50_ms']:.1f} ms, {f['requests_per_s']:.3f} req/s, {result['wall_s']:.0f} s", flush=True)


def run_vllm(setup: Setup, args: argparse.Namespace) -> None:
    """vLLM's cells: a server per arm, its cells on it (the capacity first, on the first arm's)."""
    doc = load_results(setup.results)
    reqs = window(setup)
    doc["setup"] = setup_info(setup)
    loads = chosen_loads(setup, args)
    arms = [a for a in setup.arms if not args.arms or a.name in args.arms]
    if args.again:
        set_aside(setup, doc, arms, loads, args.repeats)
    for arm in arms:
        todo = [(load, repeat) for load in loads for repeat in range(args.repeats)
                if f"{arm.name}|{load}|{repeat}" not in doc["cells"]]
        if not todo and "capacity" in doc:
            continue
        print(f"{time.strftime('%H:%M:%S')} vllm {arm.name}: starting the server", flush=True)
        server = start_vllm(arm)
        try:
            # vLLM's CPU build compiles for batch shapes as it first meets them: a burst of the window
            # first, so that the cells meet few new ones
            asyncio.run(replay(server.url, reqs[:64], [0.0] * 64, engine="vllm", salt=99))
            if "capacity" not in doc:
                result = asyncio.run(replay(server.url, reqs, [0.0] * len(reqs), engine="vllm", salt=98))
                f = figures(result)
                doc["capacity"] = {"requests_per_s": f["requests_per_s"], "arm": arm.name, "figures": f,
                                   "when": time.strftime("%Y-%m-%d %H:%M")}
                save_results(setup.results, doc)
                print(f"  capacity {f['requests_per_s']:.3f} requests/s", flush=True)
            for load, repeat in todo:
                rate = setup.loads[load] * doc["capacity"]["requests_per_s"]
                key = f"{arm.name}|{load}|{repeat}"
                print(f"{time.strftime('%H:%M:%S')} vllm {key}: {len(reqs)} requests at {rate:.3f}/s", flush=True)
                load_before = os.getloadavg()[0]
                began = time.time()
                salt = 1 + list(setup.loads).index(load) * 10 + repeat
                records = asyncio.run(replay(server.url, reqs, arrival_times(reqs, rate), engine="vllm", salt=salt))
                result = {"figures": figures(records), "records": records, "wall_s": time.time() - began}
                keep_cell(setup, doc, result, arm, load, repeat, rate, load_before, None)
        finally:
            server.stop()
            server.kill()


def cmd_run(setup: Setup, args: argparse.Namespace) -> None:
    if setup.engine == "vllm":
        run_vllm(setup, args)
        return
    doc = load_results(setup.results)
    if "capacity" not in doc:
        raise SystemExit(f"no capacity in {setup.results}: run `{Path(__file__).name} --setup {setup.name} capacity` first")
    reqs = window(setup)
    doc["setup"] = setup_info(setup)
    arms = [a for a in setup.arms if not args.arms or a.name in args.arms]
    if args.again:
        set_aside(setup, doc, arms, chosen_loads(setup, args), args.repeats)
    for load in chosen_loads(setup, args):
        rate = setup.loads[load] * doc["capacity"]["requests_per_s"]
        times = arrival_times(reqs, rate)
        for repeat in range(args.repeats):
            order = arms if repeat % 2 == 0 else arms[::-1]  # alternate: drift falls on every arm alike
            for arm in order:
                key = f"{arm.name}|{load}|{repeat}"
                if key in doc["cells"]:
                    continue
                step_log = setup.step_logs / key.replace("|", "-") if arm.who == "dpboard" else None
                print(f"{time.strftime('%H:%M:%S')} {setup.name} {key}: {len(reqs)} requests at {rate:.3f}/s", flush=True)
                load_before = os.getloadavg()[0]
                result = run_cell(setup, arm, reqs, times, step_log)
                keep_cell(setup, doc, result, arm, load, repeat, rate, load_before, step_log)


def set_aside(setup: Setup, doc: dict[str, Any], arms: list[Arm], loads: list[str], repeats: int) -> None:
    """Cells run again (``run --again``): the earlier ones' figures, when and under what load they
    ran, kept under ``earlier`` in the results file (their records are dropped), so that a rerun
    replaces a cell without losing what it had measured."""
    earlier = doc.setdefault("earlier", {})
    moved = 0
    for key in (f"{a.name}|{load}|{r}" for a in arms for load in loads for r in range(repeats)):
        cell = doc["cells"].pop(key, None)
        if cell is not None:
            earlier.setdefault(key, []).append({k: cell[k] for k in ("figures", "when", "loadavg", "wall_s") if k in cell})
            moved += 1
    save_results(setup.results, doc)
    print(f"{moved} earlier cells set aside under `earlier` in {setup.results}", flush=True)


def probe_lone(url: str, reqs: list[dict[str, Any]], engine: str = "sglang") -> list[dict[str, Any]]:
    """``PROBES`` requests of the window's lengths (outputs of 8 tokens), sent one at a time to the idle
    server, 0.3 s apart: the TTFT with no queue, what the front-end fit stands on."""
    rng = np.random.default_rng([SEED, 1])
    picked = rng.choice(len(reqs), PROBES, replace=False)
    out = []
    for n, i in enumerate(picked):
        lone = [{"offset_s": 0.0, "prompt": reqs[i]["prompt"], "output": 8}]
        record = asyncio.run(replay(url, lone, [0.0], first_index=10_000 + n, engine=engine))[0]
        out.append({"prompt": lone[0]["prompt"], "output": 8, "ttft": record["ttft"]})
        time.sleep(0.3)
    return out


def cmd_record(setup: Setup, args: argparse.Namespace) -> None:
    """One server with the step recorder and a load-aware dpboard method, the window sent at the
    setup's loads and then at once: steps of every batch shape the study's cells run, for the fit;
    then lone requests to the idle server, for the front-end fit."""
    if setup.profile_of:
        print(f"{setup.name}: no recording of its own, the simulator takes the {setup.profile_of} setup's profile")
        return
    doc = load_results(setup.results)
    if "capacity" not in doc:
        raise SystemExit(f"no capacity in {setup.results}: run `{Path(__file__).name} --setup {setup.name} capacity` first")
    logs = setup.record_logs
    if args.again and "record" in doc:  # the earlier recording's account kept, its logs replaced
        doc.setdefault("earlier", {}).setdefault("record", []).append(doc.pop("record"))
        save_results(setup.results, doc)
    if logs.exists() and any(logs.iterdir()) and "probe" in doc.get("record", {}):
        print(f"{logs} holds step logs already and {setup.results} the probe: remove both, or record --again")
        return
    shutil.rmtree(logs, ignore_errors=True)
    reqs = window(setup)
    arm = next(a for a in setup.arms if a.who == "dpboard")
    engine = setup.engine
    server = start_vllm(arm, logs) if engine == "vllm" else start_server(setup, arm, logs)
    try:
        # each pass its own prompts (salt): a prefix cache would otherwise serve the window's second pass
        asyncio.run(replay(server.url, WARM, [0.0] * len(WARM), engine=engine, salt=90))
        for n, (load, share) in enumerate(setup.loads.items()):
            asyncio.run(replay(server.url, reqs, arrival_times(reqs, share * doc["capacity"]["requests_per_s"]),
                               engine=engine, salt=91 + n))
            print(f"recorded the window at {load} load", flush=True)
        asyncio.run(replay(server.url, reqs, [0.0] * len(reqs), engine=engine, salt=89))
        for n, name in enumerate(setup.record_also):
            other = SETUPS[name]
            capacity = load_results(other.results).get("capacity")
            if capacity is None:
                raise SystemExit(f"no capacity in {other.results}: run `--setup {name} capacity` before recording "
                                 f"{setup.name}, whose recording sends {name}'s window too")
            more = window(other)
            asyncio.run(replay(server.url, more, arrival_times(more, other.loads["light"] * capacity["requests_per_s"]),
                               engine=engine, salt=85 + n))
            print(f"recorded {name}'s window at its light load", flush=True)
        time.sleep(2.0)  # idle: the schedulers asleep, as between a light load's arrivals
        probe = probe_lone(server.url, reqs, engine)
        print(f"probed {len(probe)} lone requests: TTFT median {statistics.median(p['ttft'] for p in probe) * 1e3:.1f} ms",
              flush=True)
    finally:
        server.stop()
        server.kill()
    doc["record"] = {"arm": arm.name, "loads": [*setup.loads, "at once", *(f"{n} light" for n in setup.record_also)],
                     "logs": str(logs.relative_to(ROOT)),
                     "when": time.strftime("%Y-%m-%d %H:%M"), "probe": probe}
    save_results(setup.results, doc)


def path_parts(records: list[dict[str, Any]]) -> dict[str, float]:
    """A run's TTFT taken apart by SGLang's request time stats, medians in ms: the HTTP server's
    receipt, the tokenizer, on to the scheduler (the DP controller), the scheduler's queue, the
    prefill, and the first token's way back to the client; ``outside`` is what no scheduler step
    holds: the client's TTFT less the scheduler's (its receipt to its prefill's end)."""
    parts: dict[str, list[float]] = {k: [] for k in ("ttft", "http_in", "tokenizer", "to_scheduler", "queue", "prefill",
                                                        "way_back", "outside")}
    for r in records:
        t = r.get("stamps", {})
        if not all(k in t for k in (*TIME_STATS, "sent", "first")) or t["first"] is None:
            continue
        at_scheduler = t["forward_entry_time"] - t["queue_time"]
        parts["ttft"].append(r["ttft"])
        parts["http_in"].append(t["request_received_ts"] - t["sent"])
        parts["tokenizer"].append(t["api_server_dispatch_finish_ts"] - t["request_received_ts"])
        parts["to_scheduler"].append(at_scheduler - t["api_server_dispatch_finish_ts"])
        parts["queue"].append(t["queue_time"])
        parts["prefill"].append(t["prefill_finished_time"] - t["forward_entry_time"])
        parts["way_back"].append(t["first"] - t["prefill_finished_time"])
        parts["outside"].append(r["ttft"] - (t["prefill_finished_time"] - at_scheduler))
    if not parts["ttft"]:
        raise SystemExit("no request carried SGLang's time stats: the server needs --enable-metrics")
    return {f"{k}_ms": float(np.median(v)) * 1e3 for k, v in parts.items()} | {"requests": len(parts["ttft"])}


def cmd_frontend(setup: Setup, args: argparse.Namespace) -> None:
    """The window once per load through a server with SGLang's request time stats on
    (``--enable-metrics``): what each request spent outside the schedulers under the study's loads,
    from the server's own stamps (the front end the simulator adds). Run for the first of dpboard's
    arms (the profile's figure) and the first of SGLang's own (its dispatch takes its own hop through
    the DP controller), or for ``--arm`` alone."""
    if setup.engine != "sglang" or setup.profile_of:
        print(f"{setup.name}: no `frontend` (SGLang's own setups only)")
        return
    main = next(a for a in setup.arms if a.who == "dpboard")
    if args.arm is not None:
        chosen = [a for a in setup.arms if a.name == args.arm]
        if not chosen:
            raise SystemExit(f"--arm {args.arm}: not one of {', '.join(a.name for a in setup.arms)}")
    else:
        chosen = [main, *[a for a in setup.arms if a.who == "sglang"][:1]]
    for arm in chosen:
        frontend_run(setup, arm, "frontend_run" if arm is main else f"frontend_run|{arm.name}")


def frontend_run(setup: Setup, arm: Arm, into: str) -> None:
    """One arm's front-end run, kept in the results file under ``into``."""
    doc = load_results(setup.results)
    if "capacity" not in doc:
        raise SystemExit(f"no capacity in {setup.results}: run `{Path(__file__).name} --setup {setup.name} capacity` first")
    if into in doc:
        print(f"{setup.results} holds the front-end run of {arm.name} already: remove {into} to run it again")
        return
    reqs = window(setup)
    arm = Arm(arm.name, arm.who, arm.method, (*arm.flags, "--enable-metrics"), arm.delayer)
    server = start_server(setup, arm, None)
    out: dict[str, Any] = {"arm": arm.name, "when": time.strftime("%Y-%m-%d %H:%M")}
    try:
        asyncio.run(replay(server.url, WARM, [0.0] * len(WARM), salt=80))
        for n, (load, share) in enumerate(setup.loads.items()):
            records = asyncio.run(replay(server.url, reqs, arrival_times(reqs, share * doc["capacity"]["requests_per_s"]),
                                         salt=81 + n))
            out[load] = path_parts(records)
            print(f"{arm.name} {load}: " + ", ".join(f"{k} {v:.1f}" for k, v in out[load].items()), flush=True)
    finally:
        server.stop()
        server.kill()
    doc[into] = out
    save_results(setup.results, doc)


def cmd_sim(setup: Setup, args: argparse.Namespace) -> None:
    """Fit the profile from the recorded steps and the front end from the lone requests, then every
    arm and load of the study in dpboard sim."""
    from dpboard.sim.profile import load_profile_file
    from dpboard.sim.report import summarize

    doc = load_results(setup.results)
    source, source_doc = setup, doc  # the setup whose server this one's profile and front end come from
    if setup.profile_of:  # the same server as that setup: its fit and profile
        source = SETUPS[setup.profile_of]
        source_doc = load_results(source.results)
        if "fit" not in source_doc:
            raise SystemExit(f"no fit in {source.results}: run `--setup {source.name} sim` first")
        doc["fit"] = source_doc["fit"]
        profile = load_profile_file(source.profile)
        overlap = bool(doc["fit"]["settings"].get("overlap"))
    else:
        profile, overlap = fit_setup(setup, doc)
    own_front = own_path_frontend(source, source_doc)
    if own_front is not None:
        doc["fit"]["frontend_own"] = own_front
    else:
        doc["fit"].pop("frontend_own", None)
    reqs = window(setup)
    output = np.array([r["output"] for r in reqs], dtype=np.int64)
    doc["sim"] = {}
    doc["sim_without_frontend"] = {}
    doc["sim_parts"] = {}
    for load in setup.loads:
        times = np.array(arrival_times(reqs, setup.loads[load] * doc["capacity"]["requests_per_s"]))
        trace = window_trace(setup, reqs, times)
        for arm in setup.arms:
            front_s = profile.frontend_s
            if own_front is not None and arm.who == "sglang":  # SGLang's own dispatch: its own hop, measured
                front_s = max(0.0, front_s + own_front["delta_ms"] / 1e3)
            for frontend_s, into in ((front_s, "sim"), (0.0, "sim_without_frontend")):
                result = simulate(setup, trace, profile, overlap, arm, frontend_s)
                if into == "sim_without_frontend" and arm.name == doc.get("frontend_run", {}).get("arm"):
                    doc["sim_parts"][load] = {  # beside SGLang's stamps of the same arm and load
                        "wait_ms": float(np.median(loop_waits_s(result))) * 1e3,
                        "turn_to_first_ms": float(np.median([r.first_token_s - r.admitted_s
                                                             for r in result.requests])) * 1e3}
                s = summarize(result)
                span = float(s["makespan_s"] - times.min())
                reqs_out = result.requests
                split = idle_split(np.array([r.arrival_s for r in reqs_out]), np.array([r.finished_s for r in reqs_out]),
                                   np.array([r.first_token_s - r.arrival_s for r in reqs_out]))
                doc[into][f"{arm.name}|{load}"] = {"idle_split": split,
                    "ttft_p50_ms": s["ttft_p50_ms"], "ttft_p99_ms": s["ttft_p99_ms"], "tpot_p50_ms": s["tpot_p50_ms"],
                    "tpot_p99_ms": s["tpot_p99_ms"], "output_tokens_per_s": float(output.sum()) / span,
                    "requests_per_s": len(reqs) / span,
                    "rank0_share": sum(1 for r in result.requests if r.rank == 0) / len(result.requests),
                    "cache_hit_rate": s["cache_hit_rate"]}
    save_results(setup.results, doc)


def window_trace(setup: Setup, reqs: list[dict[str, Any]], times: np.ndarray):
    """The window ``reqs`` arriving at ``times`` as a ``dpboard sim`` trace (its blocks where it has them)."""
    from dpboard.sim.trace import BlockTable, Trace

    blocks = None
    if "blocks" in reqs[0]:
        offsets = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum([len(r["blocks"]) for r in reqs], out=offsets[1:])
        blocks = BlockTable(offsets=offsets, ids=np.array([b for r in reqs for b in r["blocks"]], dtype=np.int64))
    return Trace(name=f"{setup.trace} window", n_ranks=2, seed=SEED, arrival_s=times,
                 prompt_len=np.array([r["prompt"] for r in reqs], dtype=np.int64),
                 output_len=np.array([r["output"] for r in reqs], dtype=np.int64), is_burst=np.zeros(len(reqs), bool),
                 blocks=blocks)


def simulate(setup: Setup, trace: Any, profile: Any, overlap: bool, arm: Arm, frontend_s: float):
    """``trace`` (``window_trace``) through ``dpboard sim`` with ``arm``'s method: its RunResult."""
    from dpboard.sim.simulation import SimConfig, Simulation

    config = SimConfig(n_ranks=2, rank=profile.rank, overlap_schedule=overlap,
                       lockstep=profile.lockstep if setup.dp_attention else None,
                       prefill_delayer=arm.delayer, frontend_s=frontend_s,
                       slo_ttft_s=profile.slo_ttft_s, slo_tpot_s=profile.slo_tpot_s).validate()
    return Simulation(trace, arm.method, config).run()


def loop_waits_s(result: Any) -> np.ndarray:
    """Per simulated request, its wait at its scheduler for the loop's next turn (received to admitted).
    SGLang's scheduler takes requests off its socket between forwards and its stamps time a request
    from that turn, so the stamps' part outside the scheduler holds this wait, which the simulator
    has itself (a request received during a step joins the next one)."""
    return np.array([r.admitted_s - r.received_s for r in result.requests])


def loop_wait_s(setup: Setup, doc: dict[str, Any], profile: Any, overlap: bool, arm_name: str) -> float:
    """The median of ``loop_waits_s`` for ``arm_name`` on the window at the light load."""
    reqs = window(setup)
    times = np.array(arrival_times(reqs, setup.loads["light"] * doc["capacity"]["requests_per_s"]))
    return float(np.median(loop_waits_s(simulate(setup, window_trace(setup, reqs, times), profile, overlap,
                                                 setup.arm(arm_name), 0.0))))


def fit_setup(setup: Setup, doc: dict[str, Any]):
    """The setup's profile fitted from its recording (written to ``setup.profile``), and whether the
    server ran the overlap scheduler; the fit's figures go into ``doc``."""
    from dpboard.sim.calibrate import by_shape, fit_frontend, fit_profile, table_from_logs
    from dpboard.sim.profile import load_profile_file
    from dpboard.steplog.reader import read_step_log, step_log_paths

    if "probe" not in doc.get("record", {}):
        raise SystemExit(f"no recording in {setup.results}: run `{Path(__file__).name} --setup {setup.name} record` first")
    logs = [read_step_log(p) for p in step_log_paths(setup.record_logs)]
    table, settings = table_from_logs(logs)
    fit = fit_profile(table, settings)
    overlap = bool(settings.get("overlap"))
    probe = doc["record"]["probe"]
    fitted = load_profile_from_text(fit.profile_text("unused", "unused"))
    front, front_p10, front_p90 = fit_frontend(np.array([p["prompt"] for p in probe]), np.array([p["output"] for p in probe]),
                                               np.array([p["ttft"] for p in probe]), fitted.rank, overlap=overlap)
    name = f"replay-study-cpu{'' if setup.name == 'independent' else '-' + setup.name}"
    own = [front * 1e3, front_p10 * 1e3, front_p90 * 1e3]
    source = (f"{len(probe)} lone requests on the idle server: client TTFT less the fitted model's, "
              f"median (p10 {own[1]:.1f} ms, p90 {own[2]:.1f} ms)")
    run = doc.get("frontend_run", {}).get("light")
    if run is not None:  # measured per request under the light load by the server's own stamps
        from dpboard.sim.simulation import SimConfig

        wait = loop_wait_s(setup, doc, fitted, bool(settings.get("overlap")), doc["frontend_run"]["arm"])
        # the simulator has the transit and the wait for the loop's turn
        front = max(0.0, run["outside_ms"] / 1e3 - SimConfig().send_delay_s - wait)
        source = (f"{run['requests']} requests at the light load, SGLang's request time stats (--enable-metrics): "
                  f"client TTFT less the scheduler's receipt-to-prefill-end, median, less the simulator's "
                  f"{SimConfig().send_delay_s * 1e3:g} ms transit and its {wait * 1e3:.1f} ms wait for the "
                  f"scheduler loop's turn; lone requests on the idle server: {own[0]:.1f} ms")
    elif setup.frontend_of:  # the same front end as that setup's server; this one's idle probe says more
        other = load_results(SETUPS[setup.frontend_of].results).get("fit", {}).get("frontend_ms")
        if other is None:
            raise SystemExit(f"no front end in {SETUPS[setup.frontend_of].results}: run `--setup {setup.frontend_of} sim` first")
        front = other / 1e3
        source = (f"the {setup.frontend_of} setup's (the same HTTP server, tokenizer, DP controller and "
                  f"detokenizer); this server's lone requests on an idle group took {own[0]:.1f} ms more than the model")
    setup.profile.write_text(fit.profile_text(
        name, f"the step logs of `{Path(__file__).name} --setup {setup.name} record`", frontend_ms=front * 1e3,
        frontend_source=source))
    print(fit.report())
    print(f"front end: {front * 1e3:.2f} ms; this server's lone requests: {own[0]:.2f} ms over the model "
          f"(p10 {own[1]:.2f}, p90 {own[2]:.2f}) from {len(probe)}")
    profile = load_profile_file(setup.profile)
    doc["fit"] = {"terms": {t.key: t.value for t in fit.terms}, "error": fit.error, "loose": fit.loose,
                  "steps": fit.steps, "used": fit.used, "settings": settings,
                  "frontend_ms": front * 1e3, "frontend_source": source,
                  "lone_over_model_ms": own, "by_shape": by_shape(table, fit),
                  "sync_forward": fit.sync_forward, "result_share": fit.result_share,
                  "profile": str(setup.profile.relative_to(ROOT))}
    return profile, overlap


def own_path_frontend(source: Setup, doc: dict[str, Any]) -> dict[str, Any] | None:
    """SGLang's own dispatch has its own hop through the DP controller: where a front-end run of one
    of SGLang's arms was made on ``source``'s server (``doc``: its results), what its path outside
    the schedulers took at the light load less the profile's arm's."""
    main = doc.get("frontend_run", {}).get("light")
    for arm in source.arms:
        run = doc.get(f"frontend_run|{arm.name}", {}).get("light")
        if arm.who == "sglang" and run is not None and main is not None:
            return {"arm": arm.name, "outside_ms": run["outside_ms"], "main_outside_ms": main["outside_ms"],
                    "delta_ms": run["outside_ms"] - main["outside_ms"]}
    return None


def load_profile_from_text(text: str):
    """A profile from its text (the fit before it is written), through the one reader profiles have."""
    import tempfile

    from dpboard.sim.profile import load_profile_file

    with tempfile.NamedTemporaryFile("w", suffix=".profile") as f:
        f.write(text)
        f.flush()
        return load_profile_file(f.name)


METRICS = (("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p99_ms", "TTFT p99 ms"), ("tpot_p50_ms", "TPOT p50 ms"),
           ("tpot_p99_ms", "TPOT p99 ms"), ("output_tokens_per_s", "output tok/s"))
WITHIN = 0.15  # the simulator's bar on p50s at light load: within 15 % of the real median, or its spread


def columns(setup: Setup) -> tuple[tuple[str, str], ...]:
    """The table's figures: METRICS, each rank's share, and with shared prefixes the cache's hit rate."""
    more = (("cache_hit_rate", "cache hit rate"),) if setup.trace == "mooncake" else ()
    return (*METRICS, ("rank0_share", "rank 0 share"), *more)


def real_cells(doc: dict[str, Any], arm: str, load: str) -> list[dict[str, Any]]:
    return [c["figures"] for c in doc["cells"].values() if c["arm"] == arm and c["load"] == load]


def compare(setup: Setup, doc: dict[str, Any]) -> list[dict[str, Any]]:
    """Per load, arm and figure: the real median, spread (min, max) and repeats, the simulated value,
    its error against the median and whether it is within the bar."""
    rows = []
    for load in setup.loads:
        for arm in setup.arms:
            real = real_cells(doc, arm.name, load)
            sim = doc.get("sim", {}).get(f"{arm.name}|{load}")
            bare = doc.get("sim_without_frontend", {}).get(f"{arm.name}|{load}")
            if not real:
                continue
            for key, label in columns(setup):
                values = [f[key] for f in real if f.get(key) is not None]
                if not values:
                    continue
                median = statistics.median(values)
                row = {"load": load, "arm": arm.name, "key": key, "label": label, "median": median, "min": min(values),
                       "max": max(values), "repeats": len(values), "sim": None, "error": None, "within": None,
                       "bare_error": None}
                if sim is not None and sim.get(key) is not None:
                    row["sim"] = sim[key]
                    row["error"] = (sim[key] - median) / median if median else None
                    in_spread = min(values) <= sim[key] <= max(values)
                    row["within"] = bool(in_spread or (row["error"] is not None and abs(row["error"]) <= WITHIN))
                if bare is not None and bare.get(key) is not None and median:
                    row["bare_error"] = (bare[key] - median) / median
                rows.append(row)
    return rows


def ranking(setup: Setup, doc: dict[str, Any], load: str, key: str, source: str) -> list[str]:
    """The arms from best to worst by ``key`` (lower is better), real medians or simulated values."""
    values = {}
    for arm in setup.arms:
        if source == "real":
            real = [f[key] for f in real_cells(doc, arm.name, load)]
            if real:
                values[arm.name] = statistics.median(real)
        elif f"{arm.name}|{load}" in doc.get("sim", {}):
            values[arm.name] = doc["sim"][f"{arm.name}|{load}"][key]
    return sorted(values, key=values.__getitem__)


def inseparable(setup: Setup, doc: dict[str, Any], load: str, key: str) -> list[tuple[str, str]]:
    """Pairs of arms whose real repeats overlap on ``key``: the noise cannot order them."""
    spans = {arm.name: (min(v), max(v)) for arm in setup.arms
             if (v := [f[key] for f in real_cells(doc, arm.name, load)])}
    names = list(spans)
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if spans[a][0] <= spans[b][1] and spans[b][0] <= spans[a][1]]


def render(setup: Setup, doc: dict[str, Any]) -> str:
    rows = compare(setup, doc)
    out = []
    cap = doc["capacity"]
    info = doc.get("setup", {})
    out.append(f"Capacity of the server on the window: {cap['requests_per_s']:.2f} requests/s (the {WINDOW} requests "
               f"sent at once, {cap['when']}); {info.get('machine', '')}.")
    if "fit" in doc:
        fit = doc["fit"]
        terms = ", ".join(f"{k} {v:.4g}" for k, v in fit["terms"].items())
        errors = "; ".join(f"{kind} {med:.1f} % / {p90:.1f} %" for kind, (med, p90) in fit["error"].items())
        cpu = ""
        if fit.get("sync_forward"):
            cpu = "; the forward in the scheduler's thread (`sync_forward = 1`)"
            if fit.get("result_share") is not None:
                cpu += f", a step's result out {fit['result_share']:.0%} into the next step (`result_share`)"
        out.append(f"\nFitted profile ({fit['profile']}, {fit['used'].get('extend', 0)} prefill and "
                   f"{fit['used'].get('decode', 0)} decode steps): {terms}{cpu}. Fit error per step, median / p90: "
                   f"{errors}. Not pinned down: {', '.join(fit['loose']) or 'none'}.")
        if "frontend_ms" in fit:
            out.append(f"Front end (`frontend_ms`): {fit['frontend_ms']:.1f} ms, from {fit['frontend_source']}.")
            run = doc.get("frontend_run")
            if run:
                parts = ("http_in", "tokenizer", "to_scheduler", "queue", "prefill", "way_back", "outside", "ttft")
                out.append(f"\nWhere a request's TTFT goes, by SGLang's request time stats (`--enable-metrics`, "
                           f"{run['arm']}, the window once per load; medians, ms):\n")
                out.append("| load | HTTP in | tokenizer | to scheduler | queue | prefill | way back | outside "
                           "the scheduler | TTFT |")
                out.append("|---" * (len(parts) + 1) + "|")
                for load in setup.loads:
                    if load in run:
                        out.append(f"| {load} | " + " | ".join(f"{run[load][p + '_ms']:.1f}" for p in parts) + " |")
                out.append("")
                sim_parts = doc.get("sim_parts", {})
                for load in setup.loads:
                    if load in run and load in sim_parts:
                        real = run[load]["queue_ms"] + run[load]["prefill_ms"]
                        out.append(f"- {load}: the scheduler's part, from the loop's turn that takes a request off "
                                   f"its socket to the first token processed (queue + prefill), real {real:.1f} ms, "
                                   f"simulated {sim_parts[load]['turn_to_first_ms']:.1f} ms; the simulated wait for "
                                   f"that turn {sim_parts[load]['wait_ms']:.1f} ms (in `to scheduler` above)")
                if any(load in sim_parts for load in setup.loads):
                    out.append("")
            own = fit.get("frontend_own")
            if own:
                out.append(f"SGLang's own dispatch takes its own hop through the DP controller: measured the same way "
                           f"with {own['arm']}, its path outside the schedulers took {own['outside_ms']:.1f} ms at the "
                           f"light load against {own['main_outside_ms']:.1f} ms through dpboard's, so SGLang's methods "
                           f"are simulated with a front end {own['delta_ms']:+.1f} ms from the profile's.\n")
            out.append("Each TTFT cell below gives the simulator's error with it; `without` is the error of the "
                       "same run without it.")
    for load, share in setup.loads.items():
        mine = [r for r in rows if r["load"] == load]
        if not mine:
            continue
        out.append(f"\n**{load.capitalize()} load** ({share:.1%} of capacity, "
                   f"{share * cap['requests_per_s']:.2f} requests/s; real: median [min-max] of "
                   f"{max(r['repeats'] for r in mine)} repeats{when_run(doc, load)})\n")
        out.append("| method | " + " | ".join(label for _, label in columns(setup)) + " |")
        out.append("|---" * (len(columns(setup)) + 1) + "|")
        for arm in setup.arms:
            cells = {r["key"]: r for r in mine if r["arm"] == arm.name}
            if not cells:
                continue
            row = [arm.name]
            for key, _ in columns(setup):
                r = cells.get(key)
                if r is None:
                    row.append("")
                    continue
                digits = 2 if key in ("rank0_share", "cache_hit_rate") else (1 if r["median"] < 100 else 0)
                text = f"{r['median']:.{digits}f} [{r['min']:.{digits}f}-{r['max']:.{digits}f}]"
                if r["sim"] is not None:
                    mark = "" if r["within"] else " ✗"
                    text += f"<br>sim {r['sim']:.{digits}f} ({r['error']:+.0%}){mark}"
                    if key.startswith("ttft") and r["bare_error"] is not None:
                        text += f"<br>without {r['bare_error']:+.0%}"
                row.append(text)
            out.append("| " + " | ".join(row) + " |")
        for key, label in (("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")):
            real = ranking(setup, doc, load, key, "real")
            sim = ranking(setup, doc, load, key, "sim")
            tied = inseparable(setup, doc, load, key)
            line = f"\nRanking by {label}, real: {' < '.join(real)}"
            if tied:
                line += f" (the noise cannot separate {len(tied)} of {len(real) * (len(real) - 1) // 2} pairs)"
            if sim:
                line += f"; simulated: {' < '.join(sim)}"
            out.append(line + ".")
        idle = idle_lines(setup, doc, load)
        if idle:
            out.append("\nRequests that arrived to an idle server (every earlier request had ended), per run, real "
                       "(median of the repeats) beside simulated: " + "; ".join(idle) + ".")
    return "\n".join(out) + "\n"


def when_run(doc: dict[str, Any], load: str) -> str:
    """When the load's cells ran, and where some were run again (``run --again``), the earlier runs'
    TTFT p50 beside the current ones' (medians over every method's cells)."""
    cells = [c for k, c in doc.get("cells", {}).items() if k.split("|")[1] == load and "when" in c]
    if not cells:
        return ""
    whens = sorted(c["when"] for c in cells)
    text = f", run {whens[0]} to {whens[-1][-5:]}"
    earlier = [run for k, runs in doc.get("earlier", {}).items() if "|" in k and k.split("|")[1] == load for run in runs]
    if earlier:
        before = sorted(r["when"] for r in earlier)
        text += (f"; {len(earlier)} earlier runs of these cells ({before[0]} to {before[-1]}, kept under `earlier` in the "
                 f"results file) gave a TTFT p50 of {statistics.median(r['figures']['ttft_p50_ms'] for r in earlier):.1f} "
                 f"ms, median of the cells, against {statistics.median(c['figures']['ttft_p50_ms'] for c in cells):.1f} "
                 f"ms now")
    return text


def idle_lines(setup: Setup, doc: dict[str, Any], load: str) -> list[str]:
    """Per arm at ``load``: how many requests found the server idle and their TTFT p50 beside the
    others', in the real runs (medians over the repeats) and the simulator's."""
    lines = []
    keys = ("idle", "idle_ttft_p50_ms", "busy_ttft_p50_ms")
    for arm in setup.arms:
        runs = [record_idle_split(c["records"]) for k, c in doc.get("cells", {}).items()
                if k.startswith(f"{arm.name}|{load}|") and c.get("records")]
        sim = doc.get("sim", {}).get(f"{arm.name}|{load}", {}).get("idle_split")
        if not runs or sim is None:
            continue
        real = {key: [r[key] for r in runs if r[key] is not None] for key in keys}
        real_text = {key: f"{statistics.median(v):.0f}" if v else "-" for key, v in real.items()}
        sim_text = {key: "-" if sim[key] is None else f"{sim[key]:.0f}" for key in keys}
        lines.append(f"{arm.name} {real_text['idle']} (sim {sim_text['idle']}), TTFT p50 {real_text['idle_ttft_p50_ms']} "
                     f"ms (sim {sim_text['idle_ttft_p50_ms']}) against {real_text['busy_ttft_p50_ms']} ms "
                     f"(sim {sim_text['busy_ttft_p50_ms']}) for the others")
    return lines


def picture(setup: Setup, doc: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in compare(setup, doc) if r["sim"] is not None]
    keys = [k for k, _ in METRICS[:4]]
    fig, axes = plt.subplots(1, len(keys), figsize=(4 * len(keys), 4))
    for ax, key in zip(axes, keys, strict=True):
        mine = [r for r in rows if r["key"] == key]
        for load, marker in zip(setup.loads, "os^", strict=False):
            pts = [r for r in mine if r["load"] == load]
            if not pts:
                continue
            med = np.array([r["median"] for r in pts])
            err = np.array([[r["median"] - r["min"] for r in pts], [r["max"] - r["median"] for r in pts]])
            ax.errorbar(med, [r["sim"] for r in pts], xerr=err, fmt=marker, label=f"{load} load", capsize=2)
            for r in pts:
                ax.annotate(r["arm"].replace("inflight_", "i_"), (r["median"], r["sim"]), fontsize=6)
        if not mine:
            continue
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
    fig.savefig(setup.picture, dpi=110)


def cmd_report(setup: Setup, args: argparse.Namespace) -> None:
    doc = load_results(setup.results)
    text = render(setup, doc) if doc.get("cells") else ""
    marker_open, marker_close = f"<!-- {setup.marker} -->", f"<!-- /{setup.marker} -->"
    page = DOC.read_text()
    if marker_open not in page:
        raise SystemExit(f"{DOC} has no {marker_open} ... {marker_close} section for the {setup.name} setup")
    head, _, rest = page.partition(marker_open)
    now, _, tail = rest.partition(marker_close)
    if args.check:
        if now != f"\n{text}":
            raise SystemExit(f"{DOC}'s {setup.name} section is not what {setup.results.name} renders: run "
                             f"`{Path(__file__).name} --setup {setup.name} report`")
        print(f"{DOC.name}: the {setup.name} section is current")
        return
    DOC.write_text(f"{head}{marker_open}\n{text}{marker_close}{tail}")
    if doc.get("sim"):
        picture(setup, doc)
    print(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setup", choices=list(SETUPS), default="independent",
                        help="SGLang's independent ranks (--dp-size 2), SGLang's DP attention (--enable-dp-attention "
                             "--tp-size 2), or vllm serve --data-parallel-size 2 (run in .venv-serving's Python)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("capacity")
    record = sub.add_parser("record")
    record.add_argument("--again", action="store_true", help="record again: the earlier recording's account is kept "
                                                             "under `earlier` in the results file, its logs replaced")
    front = sub.add_parser("frontend")
    front.add_argument("--arm", default=None, help="the one arm whose path is measured (default: the first of dpboard's "
                                                   "arms, the profile's figure, then the first of SGLang's own)")
    sub.add_parser("sim")
    report = sub.add_parser("report")
    report.add_argument("--check", action="store_true", help="only say whether the page's section is current")
    run = sub.add_parser("run")
    run.add_argument("--loads", nargs="+", default=None, help="of the setup's loads (default: all)")
    run.add_argument("--repeats", type=int, default=3)
    run.add_argument("--arms", nargs="*", help="of the setup's arms (default: all)")
    run.add_argument("--again", action="store_true", help="run the chosen cells again: the earlier ones' figures are "
                                                          "kept under `earlier` in the results file")
    args = parser.parse_args()
    setup = SETUPS[args.setup]
    commands = {"capacity": cmd_capacity, "run": cmd_run, "record": cmd_record, "frontend": cmd_frontend,
                "sim": cmd_sim, "report": cmd_report}
    commands[args.command](setup, args)


if __name__ == "__main__":
    main()
