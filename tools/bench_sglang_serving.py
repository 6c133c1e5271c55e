"""The plugin's cost in real SGLang serving: ``sglang.launch_server --dp-size 2 --load-balance-method
total_tokens`` on the CPU with the tiny model (tests/support/sglang_serving.py), with dpboard's plugin
(``SGLANG_PLUGINS=dpboard``, ``DPBOARD_METHOD``: the schedulers publish into the board, the DP
controller picks with dpboard's Dispatcher) and without it (``SGLANG_PLUGINS=none``: SGLang's own
shared-memory file and its own DPBudget), in alternation: one server start per arm and round, the
same requests, the same machine.

Per arm and concurrency: requests per second over the wall time of the batch; the p50 / p99 time to
the first token (a streamed ``/generate``, ``ignore_eos``, a fixed number of tokens); and the CPU
seconds each of the server's processes spent on the batch (utime + stime, every thread), per
request, by SGLang's process titles (main process, DP controller, schedulers, detokenizer). Wall
figures move with whatever else the machine runs; CPU time per request is the work itself.

docs/BENCHMARKS.md ("Real serving: SGLang") has the figures; the bar there is the plugin's requests/s
at least 0.98x without it.

Run in the environment `make test-sglang-serving` builds:
    .venv-sglang/bin/python tools/bench_sglang_serving.py [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import http.client
import json
import os
import platform
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_vllm_serving import cpu_spent, cpu_ticks, markdown, process_title, serving_parser, unready  # noqa: E402  (the vLLM benchmark's)

from tests.support.names import new_board_name  # noqa: E402
from tests.support.sglang_serving import Server, missing  # noqa: E402

LEVELS = (8, 16)
MAX_NEW_TOKENS = 32
WARMUP = 16
METHOD = "inflight_tokens"
ROLES = ("main", "data_parallel_controller", "scheduler", "detokenizer", "other")


def role(server: Server, pid: int) -> str:
    """What a process of the server is, from SGLang's process title ("sglang::scheduler_DP0" ->
    "scheduler"); the process that runs ``launch_server`` (tokenizer manager and HTTP) is "main"."""
    if pid == server.proc.pid:
        return "main"
    title = process_title(pid)
    name = title.split("::", 1)[1].split("_DP")[0] if title.startswith("sglang::") else "other"
    return name if name in ROLES else "other"


def first_token(server: Server, text: str) -> tuple[float, float]:
    """(seconds to the first streamed chunk, seconds to the end) of one streamed ``/generate``."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=600)
    try:
        t0 = time.perf_counter()
        conn.request("POST", "/generate", json.dumps({
            "text": text, "stream": True,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True, "temperature": 0.0},
        }), {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}: {response.read()[:500]!r}")
        ttft = None
        while chunk := response.read1(65536):
            if ttft is None and b"data:" in chunk:
                ttft = time.perf_counter() - t0
        return (ttft if ttft is not None else float("nan")), time.perf_counter() - t0
    finally:
        conn.close()


def measure(server: Server, concurrency: int, tag: str) -> dict:
    n = 4 * concurrency
    ticks = cpu_ticks(server, role)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(lambda i: first_token(server, f"{tag} request {i} kime sora bada"), range(n)))
    wall = time.perf_counter() - t0
    cpu = cpu_spent(ticks, cpu_ticks(server, role), ROLES)
    ttfts = sorted(r[0] for r in results)
    return {"concurrency": concurrency, "requests": n, "wall_s": wall, "requests_per_s": n / wall,
            "ttft_p50_s": statistics.median(ttfts),
            "ttft_p99_s": ttfts[min(n - 1, int(round(0.99 * (n - 1))))],
            "cpu_ms_per_request": {k: v * 1e3 / n for k, v in cpu.items()}, "load_avg": os.getloadavg()[0]}


def start(plugin: bool, method: bool = True) -> Server:
    """``plugin``: SGLANG_PLUGINS=dpboard (with ``method``, DPBOARD_METHOD too: dpboard dispatches;
    without, the schedulers publish into the board and SGLang's DPBudget dispatches from it)."""
    env = ({"SGLANG_PLUGINS": "dpboard", "DPBOARD_BOARD": new_board_name(), **({"DPBOARD_METHOD": METHOD} if method else {})}
           if plugin else {"SGLANG_PLUGINS": "none"})
    server = Server(env, extra=("--load-balance-method", "total_tokens"))
    server.wait_ready()
    return server


def run_arm(plugin: bool, levels: tuple[int, ...], method: bool = True) -> dict:
    server = start(plugin, method)
    try:
        with ThreadPoolExecutor(8) as pool:  # the first requests pay for lazy imports and allocations
            list(pool.map(lambda i: first_token(server, f"warm-up {i}"), range(WARMUP)))
        return {"plugin": plugin, "levels": [measure(server, c, "with" if plugin else "without") for c in levels]}
    finally:
        server.stop()
        server.kill()
        server.log_path.unlink(missing_ok=True)


def summarize(runs: list[dict], levels: tuple[int, ...]) -> list[dict]:
    rows = []
    for i, c in enumerate(levels):
        arms = {}
        for arm, plugin in (("with", True), ("without", False)):
            points = [run["levels"][i] for run in runs if run["plugin"] is plugin]
            arms[arm] = {
                "requests_per_s": statistics.median(p["requests_per_s"] for p in points),
                "ttft_p50_s": statistics.median(p["ttft_p50_s"] for p in points),
                "ttft_p99_s": statistics.median(p["ttft_p99_s"] for p in points),
                "rounds": ", ".join(f"{p['requests_per_s']:.2f}" for p in points),
                "cpu": {k: statistics.median(p["cpu_ms_per_request"][k] for p in points) for k in ROLES},
            }
        rows.append({"concurrency": c, **arms, "ratio": arms["with"]["requests_per_s"] / arms["without"]["requests_per_s"]})
    return rows


def tables(rows: list[dict]) -> str:
    speed = markdown(
        ["concurrent", "requests/s with", "without", "with / without", "TTFT p50 with", "without", "TTFT p99 with",
         "without", "requests/s per round (with; without)"], "rrrrrrrrl",
        [[str(r["concurrency"]), f"{r['with']['requests_per_s']:.2f}", f"{r['without']['requests_per_s']:.2f}",
          f"{r['ratio']:.3f}x", *(f"{r[arm][q] * 1e3:.0f} ms" for q in ("ttft_p50_s", "ttft_p99_s")
                                  for arm in ("with", "without")),
          f"{r['with']['rounds']}; {r['without']['rounds']}"] for r in rows])
    cpu = markdown(["concurrent", "processes", "CPU ms / request with", "without", "with − without"], "rlrrr",
                   [[str(r["concurrency"]), name, f"{r['with']['cpu'][name]:.2f}", f"{r['without']['cpu'][name]:.2f}",
                     f"{r['with']['cpu'][name] - r['without']['cpu'][name]:+.2f}"]
                    for r in rows for name in ROLES if name != "other"])
    return speed + "\n\n" + cpu


def main(argv: list[str] | None = None) -> int:
    parser = serving_parser(__doc__.split("\n")[0], "with/without pairs", "write every run's figures here")
    parser.add_argument("--board-only", action="store_true",
                        help="the plugin arm without DPBOARD_METHOD: the board's cost alone, SGLang dispatching")
    args = parser.parse_args(argv)
    if unready("bench_sglang_serving", missing()):
        return 2
    runs = []
    for round_ in range(args.rounds):
        for plugin in ((True, False) if round_ % 2 == 0 else (False, True)):
            t0 = time.monotonic()
            runs.append(run_arm(plugin, LEVELS, method=not args.board_only))
            print(f"round {round_ + 1}, {'with' if plugin else 'without'} the plugin: "
                  f"{time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    rows = summarize(runs, LEVELS)
    print(f"{platform.node()}, {os.cpu_count()} cores, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
          f"{args.rounds} rounds, {MAX_NEW_TOKENS} tokens per request, "
          f"{'no DPBOARD_METHOD (SGLang dispatches)' if args.board_only else f'DPBOARD_METHOD={METHOD}'}\n")
    print(tables(rows))
    if args.json:
        args.json.write_text(json.dumps({"runs": runs, "summary": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
