"""What the dispatch record costs a plugin's dispatcher per request: the pick (``Dispatcher.dispatch``,
inflight_tokens over a live 8-slot board, its 20 ms refresh throttle as in the plugins) with its
board reader as the plugins had it, and wrapped in ``TickingReader`` as they have it now (the record
published from the refreshes, the requests per rank read from the budget), interleaved in one
process; and one ``DispatchTally.publish`` (at most every 0.1 s). Run from the repository root:
``python tools/bench_dispatch_record.py [--quick]``.
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dpboard import Board, LoadSnapshot  # noqa: E402
from dpboard.bench.stats import machine_line  # noqa: E402
from dpboard.board.dispatch_record import DispatchRecord, DispatchTally, TickingReader  # noqa: E402
from dpboard.controller import Dispatcher  # noqa: E402

SLOTS = 8


class Req:
    __slots__ = ("input_ids", "routed_dp_rank", "bootstrap_room")

    def __init__(self) -> None:
        self.input_ids = list(range(100))
        self.routed_dp_rank = None
        self.bootstrap_room = None


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def main(quick: bool) -> None:
    name = f"bench-record-{time.monotonic_ns()}"
    board = Board.create(name, SLOTS)
    writers = [board.writer(r) for r in range(SLOTS)]
    for r, w in enumerate(writers):
        w.publish(LoadSnapshot(dp_rank=r, num_total_tokens=100 * r, max_total_num_tokens=10**6))
    record = DispatchRecord.open(name, 1, SLOTS)
    tally = DispatchTally(record, record.row(0, method="inflight_tokens", refresh_interval=0.02))
    without = Dispatcher("inflight_tokens", SLOTS, reader=board.reader(stale_after=60.0))
    with_record = Dispatcher("inflight_tokens", SLOTS, reader=TickingReader(board.reader(stale_after=60.0), tally))
    tally.source = with_record.budget.sent_reqs.copy
    req = Req()
    calls, rounds = (2_000, 10) if quick else (20_000, 40)

    def timed(dispatcher: Dispatcher) -> float:
        dispatch = dispatcher.dispatch
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            dispatch(req)
        return (time.perf_counter_ns() - t0) / calls

    results: dict[str, list[float]] = {"pick, board reader (before)": [], "pick, `TickingReader` (now)": []}
    for _ in range(rounds):
        results["pick, board reader (before)"].append(timed(without))
        results["pick, `TickingReader` (now)"].append(timed(with_record))
    publishes = []
    for _ in range(rounds):
        t0 = time.perf_counter_ns()
        for _ in range(100):
            tally.publish()
        publishes.append((time.perf_counter_ns() - t0) / 100)
    print(f"## The dispatch record's cost ({machine_line()}{', quick' if quick else ''})\n")
    print(f"{rounds} interleaved rounds of {calls} calls; per call, median / p90 / p99 of the rounds; "
          f"{tally.refreshes} refreshes published from\n")
    print("| | median | p90 | p99 |\n|---|---|---|---|")
    for label, values in results.items():
        print(f"| {label} | {statistics.median(values):.0f} ns | {percentile(values, 0.9):.0f} ns | "
              f"{percentile(values, 0.99):.0f} ns |")
    print(f"| `DispatchTally.publish` (at most every 0.1 s) | {statistics.median(publishes):.0f} ns | "
          f"{percentile(publishes, 0.9):.0f} ns | {percentile(publishes, 0.99):.0f} ns |")
    record.close()
    record.unlink()
    board.close()
    board.unlink()


if __name__ == "__main__":
    main("--quick" in sys.argv[1:])
