"""The plugin's cost in real serving: ``vllm serve --data-parallel-size 2`` on vLLM's CPU build and the tiny
model, with dpboard's plugin (engine cores publishing, API servers picking by DPBOARD_METHOD) and without
it (no DPBOARD_ setting: the plugin is installed, and ``register`` returns before it patches anything),
in alternation: one server start per arm and round, the same requests, the same machine.

Per arm and concurrency: completion tokens per second over the wall time of the batch, and the p50 /
p99 latency of one request (a non-streamed completion, ``ignore_eos``, a fixed number of tokens); and
the CPU time each of the server's processes spent on the batch (utime + stime from /proc/PID/stat,
every thread), per request and per token, grouped by vLLM's process titles (API servers, engine
cores, their model workers, the DP coordinator, the launcher). Wall-clock figures move with whatever else the machine
runs; CPU time per request is the work itself, and holds on a busy machine.

``--profile DIR``: after each arm's measured batches, one more batch at the highest concurrency with
py-spy recording every API server and engine core (raw folded stacks into DIR, excluded from the
figures), and the share of their samples inside dpboard's code, by function.

docs/BENCHMARKS.md ("Real serving") has the figures; the bar there is the plugin's tokens/s at least
0.98x without it at 16 and 32 concurrent requests.

Run in the environment `make test-serving` builds:
    .venv-serving/bin/python tools/bench_vllm_serving.py [--rounds 2] [--json FILE] [--profile DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.names import new_board_name  # noqa: E402
from tests.support.vllm_serving import ROOT, Server, missing  # noqa: E402

LEVELS = (1, 16, 32)
MAX_TOKENS = 64
WARMUP = 32
METHOD = "inflight_requests"


def requests_at(concurrency: int) -> int:
    return 24 if concurrency == 1 else 10 * concurrency


TICK = os.sysconf("SC_CLK_TCK")
ROLES = ("APIServer", "EngineCore", "Worker", "DPCoordinator", "launcher", "other")
_NUMBERED = re.compile(r"(_DP)?_?\d+$")


def process_title(pid: int) -> str:
    """A process's title (its first argument, which the engines set to what the process is), "" once gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
    except OSError:
        return ""


def role(server: Server, pid: int) -> str:
    """What a process of the server is, from vLLM's process title ("VLLM::EngineCore_DP0" ->
    "EngineCore"); the ``vllm serve`` process itself is the launcher."""
    if pid == server.proc.pid:
        return "launcher"
    title = process_title(pid)
    if "::" not in title:
        return "other"
    name = _NUMBERED.sub("", title.split("::", 1)[1])
    return name if name in ROLES else "other"


def cpu_ticks(server: Any, role_of: Callable[[Any, int], str] | None = None) -> dict[int, tuple[str, int]]:
    """pid -> (its role, utime + stime in clock ticks, every thread) for each live process of the server
    (``role_of(server, pid)``: vLLM's process titles unless said otherwise)."""
    role_of = role if role_of is None else role_of
    out = {}
    for pid in server.pids():
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[pid] = (role_of(server, pid), int(fields[11]) + int(fields[12]))
    return out


def cpu_spent(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]],
              roles: tuple[str, ...] = ROLES) -> dict[str, float]:
    """CPU seconds per role between two ``cpu_ticks`` (a process that started in between counts from 0)."""
    spent = dict.fromkeys(roles, 0.0)
    for pid, (name, ticks) in after.items():
        spent[name] += (ticks - before.get(pid, (name, 0))[1]) / TICK
    return spent


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

    ticks = cpu_ticks(server)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for took, got in pool.map(one, range(n)):
            latencies.append(took)
            tokens += got
    wall = time.perf_counter() - t0
    cpu = cpu_spent(ticks, cpu_ticks(server))
    latencies.sort()
    return {"concurrency": concurrency, "requests": n, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "p50_s": statistics.median(latencies),
            "p99_s": latencies[min(len(latencies) - 1, int(round(0.99 * (len(latencies) - 1))))],
            "cpu_s": cpu, "load_avg": os.getloadavg()[0]}


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


def profile(server: Server, concurrency: int, folder: Path, arm: str) -> dict[str, dict]:
    """One batch at ``concurrency`` with py-spy recording each API server and engine core: per
    process, its samples and the share of them with a dpboard frame, by dpboard function."""
    spy = shutil.which("py-spy", path=str(Path(sys.executable).parent)) or shutil.which("py-spy")
    if spy is None:
        raise SystemExit("bench_vllm_serving: --profile needs py-spy: pip install py-spy (into this environment)")
    targets = {pid: name for pid, (name, _) in cpu_ticks(server).items() if name in ("APIServer", "EngineCore")}
    n = requests_at(concurrency)
    seconds = max(5, int(n * MAX_TOKENS / 1000))  # about the batch at 1,000 tokens/s
    spies = {}
    for k, (pid, name) in enumerate(sorted(targets.items(), key=lambda t: (t[1], t[0]))):
        out = folder / f"{arm}-{name}{k}-{pid}.txt"
        spies[f"{name}{k}"] = (out, subprocess.Popen(
            [spy, "record", "--format", "raw", "--rate", "100", "-d", str(seconds), "-p", str(pid), "-o", str(out)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    time.sleep(1.0)  # py-spy attached before the batch
    measure(server, concurrency, n, f"{arm} profiled")
    shares = {}
    for label, (out, proc) in spies.items():
        try:
            proc.wait(timeout=seconds + 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        shares[label] = folded_share(out) if out.exists() else {"samples": 0}
    return shares


# innermost frames of a thread that waits (py-spy samples idle threads too, and a waiting engine
# core spins in sched_yield for its worker's answer)
WAITING = {"Condition.wait", "Condition._acquire_restore", "Event.wait", "_PollLikeSelector.select", "Poller.poll",
           "sched_yield", "_worker"}
_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")


def _source_line(path: str, line: str) -> str:
    try:
        return (ROOT / path).read_text().splitlines()[int(line) - 1]
    except (OSError, IndexError, ValueError):
        return ""


def folded_share(path: Path) -> dict:
    """From py-spy's raw output (one "frame;frame;... count" line per stack): the samples, those of a
    waiting thread, and of the others (at work) those in dpboard's own code, by its innermost
    dpboard function. A wrapper's frame on the line that calls vLLM's original method is vLLM's
    time, not dpboard's. (An API server's uvloop event loop is C: its work shows as ``Runner.run``.)"""
    total = waiting = ours = 0
    by_function: dict[str, int] = {}
    for text in path.read_text().splitlines():
        stack, _, count = text.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = [m.groups() for m in (_FRAME.match(f.strip()) for f in stack.split(";")) if m]
        if not frames or frames[-1][0] in WAITING:
            waiting += n
            continue
        own = [f for f in frames if f[1].startswith("dpboard/") and "original" not in _source_line(f[1], f[2])]
        if own:
            ours += n
            name = f"{own[-1][0]} ({own[-1][1]}:{own[-1][2]})"
            by_function[name] = by_function.get(name, 0) + n
    top = sorted(by_function.items(), key=lambda kv: -kv[1])[:8]
    busy = total - waiting
    return {"samples": total, "waiting": waiting, "dpboard": ours, "share": ours / max(1, busy), "functions": dict(top)}


def start(plugin: bool) -> Server:
    """A server of one arm, starting (``wait_ready`` next)."""
    board = new_board_name()
    env = {"DPBOARD_VLLM_BOARD": board, "DPBOARD_METHOD": METHOD, "VLLM_PLUGINS": "dpboard"} if plugin else {}
    server = Server(env)
    server.board = board
    server.plugin = plugin
    return server


def warm(server: Server) -> None:
    with ThreadPoolExecutor(16) as pool:  # every batch shape's first run compiles
        list(pool.map(lambda i: server.completion(f"warm {i}", MAX_TOKENS, timeout=600), range(WARMUP)))


def batch(server: Server, concurrency: int) -> dict:
    """One measured batch; with the plugin, how the engines' slots read meanwhile and the split."""
    watch = StaleWatch(server.board) if server.plugin else None
    before = split(server, [0, 0]) if server.plugin else None
    row = measure(server, concurrency, requests_at(concurrency), "with" if server.plugin else "without")
    if watch is not None:
        row.update(stale_share=watch.close(), split=split(server, before))
    return row


def run_arm(plugin: bool, levels: tuple[int, ...], profile_to: Path | None = None) -> dict:
    server = start(plugin)
    try:
        ready = server.wait_ready()
        warm(server)
        rows = [batch(server, c) for c in levels]
        profiled = None if profile_to is None else profile(server, max(levels), profile_to,
                                                           "with" if plugin else "without")
        stopped = server.stop()
    finally:
        server.kill()
        server.log_path.unlink(missing_ok=True)
    out = {"plugin": plugin, "ready_s": ready, "stop_s": stopped, "levels": rows}
    if profiled is not None:
        out["profile"] = profiled
    return out


PAIRED_MEMORY = 16 << 30  # two servers of about 7 GiB each, and room for the rest


def paired(levels: tuple[int, ...], rounds: int, profile_to: Path | None = None) -> list[dict]:
    """Both servers up at once, the measured one alone at work: per round and concurrency one batch
    on each, the order swapped every round, so that whatever else the machine runs falls on both
    arms alike, seconds apart instead of a server start apart. Each row also has the CPU the idle
    server spent meanwhile (``idle_cpu_s``)."""
    servers = {plugin: start(plugin) for plugin in (True, False)}
    runs = [{"plugin": plugin, "round": r + 1, "levels": []} for r in range(rounds) for plugin in (True, False)]
    try:
        for server in servers.values():
            server.wait_ready()
        for server in servers.values():
            warm(server)
        for r in range(rounds):
            for c in levels:
                for plugin in ((True, False) if r % 2 == 0 else (False, True)):
                    other = servers[not plugin]
                    idle = cpu_ticks(other)
                    row = batch(servers[plugin], c)
                    row["idle_cpu_s"] = sum(cpu_spent(idle, cpu_ticks(other)).values())
                    next(run for run in runs if run["plugin"] is plugin and run["round"] == r + 1)["levels"].append(row)
                pair = [run["levels"][-1]["tokens_per_s"] for run in runs if run["round"] == r + 1]
                print(f"round {r + 1}, {c} concurrent: with {pair[0]:.0f}, without {pair[1]:.0f} tok/s "
                      f"({pair[0] / pair[1]:.3f}x), load {os.getloadavg()[0]:.1f}", flush=True)
        if profile_to is not None:
            for plugin, server in servers.items():
                runs[0 if plugin else 1]["profile"] = profile(server, max(levels), profile_to,
                                                              "with" if plugin else "without")
        for server in servers.values():
            server.stop()
    finally:
        for server in servers.values():
            server.kill()
            server.log_path.unlink(missing_ok=True)
    return runs


def pair_ratios(runs: list[dict], levels: tuple[int, ...]) -> dict[int, list[float]]:
    """Per concurrency, each round's with / without tokens/s (paired runs: the two batches seconds apart)."""
    out: dict[int, list[float]] = {}
    for k, c in enumerate(levels):
        for r in sorted({run["round"] for run in runs}):
            arms = {run["plugin"]: run["levels"][k]["tokens_per_s"] for run in runs if run["round"] == r}
            out.setdefault(c, []).append(arms[True] / arms[False])
    return out


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) << 10
    return 0


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


def cpu_summary(runs: list[dict], levels: tuple[int, ...]) -> list[dict]:
    """Per concurrency and role: the median over the rounds of CPU ms per request and µs per token,
    with the plugin and without."""
    out = []
    for c in levels:
        for name in (*ROLES, "all"):
            row = {"concurrency": c, "role": name}
            for plugin in (True, False):
                arm = [lvl for r in runs if r["plugin"] is plugin for lvl in r["levels"] if lvl["concurrency"] == c]
                spent = [(sum(a["cpu_s"].values()) if name == "all" else a["cpu_s"][name], a) for a in arm]
                key = "with" if plugin else "without"
                row[key] = {"ms_per_request": statistics.median(1e3 * s / a["requests"] for s, a in spent),
                            "us_per_token": statistics.median(1e6 * s / a["tokens"] for s, a in spent),
                            "rounds": [round(1e3 * s / a["requests"], 2) for s, a in spent]}
            out.append(row)
    return out


def markdown(header: list[str], align: str, rows: list[list[str]]) -> str:
    """A Markdown table: ``align`` one character a column, "r" right, "l" left."""
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    return "\n".join(["| " + " | ".join(header) + " |", rule, *("| " + " | ".join(r) + " |" for r in rows)])


def cpu_table(rows: list[dict]) -> str:
    return markdown(["concurrent", "processes", "CPU ms / request with", "without", "with − without",
                     "µs / token with", "without", "per round, ms / request (with; without)"], "rlrrrrrl",
                    [[str(row["concurrency"]), row["role"], f"{row['with']['ms_per_request']:.2f}",
                      f"{row['without']['ms_per_request']:.2f}",
                      f"{row['with']['ms_per_request'] - row['without']['ms_per_request']:+.2f}",
                      f"{row['with']['us_per_token']:.1f}", f"{row['without']['us_per_token']:.1f}",
                      f"{row['with']['rounds']}; {row['without']['rounds']}"] for row in rows])


def table(summary: list[dict]) -> str:
    return markdown(["concurrent", "tokens/s with", "tokens/s without", "with / without", "p50 with", "p50 without",
                     "p99 with", "p99 without", "tokens/s per round (with; without)"], "rrrrrrrrl",
                    [[str(row["concurrency"]), f"{row['with']['tokens_per_s']:.0f}",
                      f"{row['without']['tokens_per_s']:.0f}", f"{row['ratio']:.3f}x",
                      *(f"{row[arm][q] * 1e3:.0f} ms" for q in ("p50_s", "p99_s") for arm in ("with", "without")),
                      f"{row['with']['rounds']}; {row['without']['rounds']}"] for row in summary])


def print_profile(run: dict) -> None:
    for label, share in run.get("profile", {}).items():
        print(f"  py-spy, {'with' if run['plugin'] else 'without'} the plugin, {label}: {share['samples']} samples, "
              f"{share.get('waiting', 0)} waiting, {share.get('dpboard', 0)} in dpboard "
              f"({100 * share.get('share', 0):.1f} % of those at work): {share.get('functions', {})}", flush=True)


def serving_parser(description: str, rounds_help: str, json_help: str) -> argparse.ArgumentParser:
    """The options both serving benchmarks take: ``--rounds`` (arms alternating) and ``--json``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=2, help=f"{rounds_help}, alternating (default 2)")
    parser.add_argument("--json", type=Path, help=json_help)
    return parser


def unready(tool: str, reason: str | None) -> bool:
    """Says on stderr why the serving environment is not there (the benchmark then exits 2)."""
    if reason:
        print(f"{tool}: {reason}", file=sys.stderr)
    return bool(reason)


def main(argv: list[str] | None = None) -> int:
    parser = serving_parser(__doc__.split("\n")[0], "server starts per arm", "write the figures here too")
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS), help="concurrent requests")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="also one py-spy'd batch per arm (not in the figures), its folded stacks into DIR")
    parser.add_argument("--paired", action="store_true",
                        help="both servers up at once, batches alternating between them (needs ~16 GiB free)")
    parser.add_argument("--attribute", action="store_true",
                        help="instead: one server with the plugin, dpboard's pick against vLLM's own in alternation")
    args = parser.parse_args(argv)
    if unready("bench_vllm_serving", missing()):
        return 2
    if args.json is not None and not args.json.parent.is_dir():
        print(f"bench_vllm_serving: no folder {args.json.parent} for --json", file=sys.stderr)
        return 2
    if args.profile is not None:
        args.profile.mkdir(parents=True, exist_ok=True)
    levels = tuple(args.levels)
    if args.attribute:
        rows = attribute(levels, args.rounds)
        if args.json is not None:
            args.json.write_text(json.dumps({"attribute": rows}, indent=1))
        return 0
    runs = []
    if args.paired:
        if mem_available() < PAIRED_MEMORY:
            print(f"bench_vllm_serving: --paired runs two servers of about 7 GiB each; "
                  f"{mem_available() / 2**30:.1f} GiB is available: run it without --paired", file=sys.stderr)
            return 2
        runs = paired(levels, args.rounds, args.profile)
    for r in range(0 if args.paired else args.rounds):
        for plugin in ((True, False) if r % 2 == 0 else (False, True)):
            run = run_arm(plugin, levels, args.profile)
            print(f"round {r + 1}, {'with' if plugin else 'without'} the plugin: ready in {run['ready_s']:.0f} s, "
                  + ", ".join(f"{lvl['concurrency']}: {lvl['tokens_per_s']:.0f} tok/s, "
                              f"{1e3 * sum(lvl['cpu_s'].values()) / lvl['requests']:.1f} CPU ms/request, "
                              f"load {lvl['load_avg']:.1f}"
                              + (f" (split {lvl['split']}, an engine not live {100 * lvl['stale_share']:.1f} %)"
                                 if "split" in lvl else "") for lvl in run["levels"]),
                  flush=True)
            print_profile(run)
            runs.append(run)
    for run in runs if args.paired else ():
        print_profile(run)
    summary = summarize(runs, levels)
    cpu = cpu_summary(runs, levels)
    print(f"\n{platform.processor() or platform.machine()}, {time.strftime('%Y-%m-%d %H:%M')}, {args.rounds} rounds, "
          f"load average at the batches {min(lvl['load_avg'] for r in runs for lvl in r['levels']):.1f} to "
          f"{max(lvl['load_avg'] for r in runs for lvl in r['levels']):.1f}\n")
    print(table(summary))
    ratios = pair_ratios(runs, levels) if args.paired else {}
    for c, values in ratios.items():
        print(f"{c} concurrent, with / without per pair: median {statistics.median(values):.3f}x, "
              f"{min(values):.3f}x to {max(values):.3f}x over {len(values)} pairs")
    print()
    print(cpu_table(cpu))
    if args.json is not None:
        args.json.write_text(json.dumps({"runs": runs, "summary": summary, "cpu": cpu, "pair_ratios": ratios},
                                        indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
