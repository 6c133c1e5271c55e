"""The plugin's cost in real serving: ``vllm serve --data-parallel-size 2`` on vLLM's CPU build and the tiny
model, with dpboard's plugin (engine cores publishing, API servers picking by DPBOARD_METHOD) and without
it (no DPBOARD_ setting: the plugin is installed, and ``register`` returns before it patches anything),
in alternation: one server start per arm and round, the same requests, the same machine.

Per arm and concurrency: completion tokens per second over the wall time of the batch, and the p50 /
p99 latency of one request (a non-streamed completion, ``ignore_eos``, a fixed number of tokens).
docs/BENCHMARKS.md ("Real serving") has the figures; the bar there is the plugin's tokens/s at least
0.98x without it at 16 and 32 concurrent requests.

Run in the environment `make test-serving` builds:
    .venv-serving/bin/python tools/bench_vllm_serving.py [--rounds 2] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.names import new_board_name  # noqa: E402
from tests.support.vllm_serving import Server, missing  # noqa: E402

LEVELS = (1, 16, 32)
MAX_TOKENS = 64
WARMUP = 32
METHOD = "inflight_requests"


def requests_at(concurrency: int) -> int:
    return 24 if concurrency == 1 else 10 * concurrency


def measure(server: Server, concurrency: int, n: int, tag: str) -> dict:
    latencies: list[float] = []
    tokens = 0

    def one(i: int) -> tuple[float, int]:
        t0 = time.perf_counter()
        status, answer = server.completion(f"{tag} request {i} kime sora bada", MAX_TOKENS, timeout=600)
        took = time.perf_counter() - t0
        if status != 200:
            raise RuntimeError(f"HTTP {status}: {answer}")
        return took, int(answer["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for took, got in pool.map(one, range(n)):
            latencies.append(took)
            tokens += got
    wall = time.perf_counter() - t0
    latencies.sort()
    return {"concurrency": concurrency, "requests": n, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))]}


class StaleWatch:
    """Samples the board every 20 ms while a batch runs: the share of samples in which an engine's
    slot read as not LIVE with the dispatcher's threshold (DPBOARD_STALE_AFTER, 1 s), when dpboard's
    methods leave that engine out of their picks."""

    def __init__(self, board: str) -> None:
        from dpboard.board import Board

        self._board = Board.attach(board)
        self._reader = self._board.reader(stale_after=1.0)
        self._stop = threading.Event()
        self.samples = self.stale = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from dpboard.snapshot import SlotStatus

        while not self._stop.wait(0.02):
            self.samples += 1
            if (self._reader.read_array()["status"] != int(SlotStatus.LIVE)).any():
                self.stale += 1

    def close(self) -> float:
        self._stop.set()
        self._thread.join(timeout=5)
        self._board.close()
        return self.stale / max(1, self.samples)


def run_arm(plugin: bool, levels: tuple[int, ...]) -> dict:
    board = new_board_name()
    env = {"DPBOARD_VLLM_BOARD": board, "DPBOARD_METHOD": METHOD, "VLLM_PLUGINS": "dpboard"} if plugin else {}
    server = Server(env)
    server.board = board
    try:
        ready = server.wait_ready()
        with ThreadPoolExecutor(16) as pool:  # warm-up: every batch shape's first run compiles
            list(pool.map(lambda i: server.completion(f"warm {i}", MAX_TOKENS, timeout=600), range(WARMUP)))
        rows = []
        for c in levels:
            watch = StaleWatch(board) if plugin else None
            before = split(server, [0, 0]) if plugin else None
            row = measure(server, c, requests_at(c), "with" if plugin else "without")
            if watch is not None:
                row.update(stale_share=watch.close(), split=split(server, before))
            rows.append(row)
        stopped = server.stop()
    finally:
        server.kill()
        server.log_path.unlink(missing_ok=True)
    return {"plugin": plugin, "ready_s": ready, "stop_s": stopped, "levels": rows}


def split(server: Server, before: list[int]) -> list[int]:
    """Requests each engine received since ``before`` (the board's received counts)."""
    from dpboard.board import Board

    with Board.attach(server.board) as board:
        received = board.reader(stale_after=5.0).read_array()["num_received_reqs"].tolist()
    return [a - b for a, b in zip(received, before, strict=True)]


def attribute(levels: tuple[int, ...], rounds: int) -> list[dict]:
    """One server with the plugin, dpboard's pick and vLLM's own pick in alternating batches: the
    fault file of tests/support/vllm_serving_fault makes dpboard's pick raise, so that vLLM's pick
    places every request while the engine cores publish as before. Tells the pick's share of the
    cost from the engine side's, and shows each pick's split over the two engines."""
    import tempfile

    fault = Path(tempfile.mkdtemp()) / "raise-in-pick"
    board = new_board_name()
    server = Server({"DPBOARD_VLLM_BOARD": board, "DPBOARD_METHOD": METHOD, "VLLM_PLUGINS": "dpboard"},
                    fault_file=fault)
    server.board = board
    rows = []
    try:
        server.wait_ready()
        with ThreadPoolExecutor(16) as pool:
            list(pool.map(lambda i: server.completion(f"warm {i}", MAX_TOKENS, timeout=600), range(WARMUP)))
        for r in range(rounds):
            for c in levels:
                for vllm_pick in ((False, True) if r % 2 == 0 else (True, False)):
                    if vllm_pick:
                        fault.touch()
                    before = split(server, [0, 0])
                    row = measure(server, c, requests_at(c), "vllm" if vllm_pick else "dpboard")
                    fault.unlink(missing_ok=True)
                    row.update(pick="vLLM's" if vllm_pick else "dpboard's", round=r + 1, split=split(server, before))
                    print(f"round {r + 1}, {row['pick']} pick, {c}: {row['tokens_per_s']:.0f} tok/s, "
                          f"split {row['split']}", flush=True)
                    rows.append(row)
        server.stop()
    finally:
        fault.unlink(missing_ok=True)
        server.kill()
        server.log_path.unlink(missing_ok=True)
    return rows


def summarize(runs: list[dict], levels: tuple[int, ...]) -> list[dict]:
    out = []
    for c in levels:
        row = {"concurrency": c}
        for plugin in (True, False):
            arm = [lvl for r in runs if r["plugin"] is plugin for lvl in r["levels"] if lvl["concurrency"] == c]
            key = "with" if plugin else "without"
            row[key] = {"tokens_per_s": statistics.median(a["tokens_per_s"] for a in arm),
                        "p50_s": statistics.median(a["p50_s"] for a in arm),
                        "p99_s": statistics.median(a["p99_s"] for a in arm),
                        "rounds": [round(a["tokens_per_s"], 1) for a in arm]}
        row["ratio"] = row["with"]["tokens_per_s"] / row["without"]["tokens_per_s"]
        out.append(row)
    return out


def table(summary: list[dict]) -> str:
    lines = ["| concurrent | tokens/s with | tokens/s without | with / without | p50 with | p50 without | "
             "p99 with | p99 without | tokens/s per round (with; without) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for row in summary:
        w, wo = row["with"], row["without"]
        lines.append(f"| {row['concurrency']} | {w['tokens_per_s']:.0f} | {wo['tokens_per_s']:.0f} | "
                     f"{row['ratio']:.3f}x | {w['p50_s'] * 1e3:.0f} ms | {wo['p50_s'] * 1e3:.0f} ms | "
                     f"{w['p99_s'] * 1e3:.0f} ms | {wo['p99_s'] * 1e3:.0f} ms | {w['rounds']}; {wo['rounds']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2, help="server starts per arm, alternating (default 2)")
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), help="concurrent requests")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--attribute", action="store_true",
                        help="instead: one server with the plugin, dpboard's pick against vLLM's own in alternation")
    args = parser.parse_args(argv)
    reason = missing()
    if reason:
        print(f"bench_vllm_serving: {reason}", file=sys.stderr)
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"bench_vllm_serving: no folder {args.json.parent} for --json", file=sys.stderr)
        return 2
    levels = tuple(args.levels)
    if args.attribute:
        rows = attribute(levels, args.rounds)
        if args.json is not None:
            args.json.write_text(json.dumps({"attribute": rows}, indent=1))
        return 0
    runs = []
    for r in range(args.rounds):
        for plugin in ((True, False) if r % 2 == 0 else (False, True)):
            run = run_arm(plugin, levels)
            print(f"round {r + 1}, {'with' if plugin else 'without'} the plugin: ready in {run['ready_s']:.0f} s, "
                  + ", ".join(f"{lvl['concurrency']}: {lvl['tokens_per_s']:.0f} tok/s"
                              + (f" (split {lvl['split']}, an engine not live {100 * lvl['stale_share']:.1f} %)"
                                 if "split" in lvl else "") for lvl in run["levels"]),
                  flush=True)
            runs.append(run)
    summary = summarize(runs, levels)
    print(f"\n{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d')}, {args.rounds} rounds\n")
    print(table(summary))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
