"""Start-up of the read-only commands beside a bare interpreter: ``dpboard ls``, ``info``, ``clean``
and ``doctor --json`` against ``python -c pass`` and ``python -c "import numpy"``, in one run.

Each command runs as a user runs it, a fresh ``python -m dpboard`` process, on a board of 8 slots
this topic creates (4 live ones) and removes; ``clean`` is given that board's name and refused (the
board is alive), so nothing is removed; ``doctor`` watches a window of 0.01 s (its two reads back to
back) so that the time is its start-up, not its window. The runs of all commands are interleaved,
round after round, so that a change in the machine's load falls on all of them alike; the figure
is the median wall time of a run (and its 90th percentile), from ``fork`` to exit.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from dpboard.bench.stats import machine_line, markdown_table, topic_parser, write_json

SLOTS = 8
LIVE = 4


def commands(board: str) -> dict[str, list[str]]:
    py = sys.executable
    dp = [py, "-m", "dpboard"]
    return {
        "python -c pass": [py, "-c", "pass"],
        'python -c "import numpy"': [py, "-c", "import numpy"],
        "dpboard ls": [*dp, "ls"],
        "dpboard info NAME": [*dp, "info", board],
        "dpboard clean NAME": [*dp, "clean", board],
        "dpboard doctor NAME --json": [*dp, "doctor", board, "--window", "0.01", "--samples", "2", "--json"],
    }


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(0.9 * len(ordered)))]


def measure(rounds: int) -> dict:
    from dpboard.board import Board
    from dpboard.snapshot import LoadSnapshot

    board_name = f"bench-startup-{os.getpid()}"
    times: dict[str, list[float]] = {}
    with Board.create(board_name, n_slots=SLOTS) as board:
        writers = [board.writer(r) for r in range(LIVE)]
        cmds = commands(board_name)
        # bytecode cached, as in an installed package: the first round writes what is missing
        env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        for _ in range(rounds + 1):  # a first round to warm the caches, not counted
            for w in writers:  # live all along: clean refuses it, doctor finds its ranks live
                w.publish(LoadSnapshot(dp_rank=w.rank, num_running_reqs=3, max_total_num_tokens=1000))
            for label, argv in cmds.items():
                start = time.perf_counter()
                subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, timeout=120)
                times.setdefault(label, []).append(time.perf_counter() - start)
        for w in writers:
            w.close()
    for label in times:
        del times[label][0]
    base = _median(times["python -c pass"])
    rows = {label: {"median_ms": 1e3 * _median(v), "p90_ms": 1e3 * _p90(v), "vs_python": _median(v) / base}
            for label, v in times.items()}
    return {"rounds": rounds, "machine": machine_line(), "load_average": os.getloadavg()[0], "commands": rows}


def table(doc: dict) -> str:
    rows = [(label, f"{r['median_ms']:.0f} ms", f"{r['p90_ms']:.0f} ms", f"{r['vs_python']:.2f}x")
            for label, r in doc["commands"].items()]
    return markdown_table(["command", "median", "p90", "vs python -c pass"], rows)


def _parser() -> argparse.ArgumentParser:
    return topic_parser("startup", __doc__, "3 rounds instead of 20 (a smoke run)")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    doc = measure(3 if args.quick else 20)
    doc["quick"] = args.quick
    print(f"start-up of the read-only commands, {doc['rounds']} rounds; {doc['machine']}; "
          f"load average {doc['load_average']:.1f}")
    print(table(doc))
    write_json(args.json, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
