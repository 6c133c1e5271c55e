"""Writer processes that put a board into the states ``dpboard doctor`` diagnoses (no tests of its own).

``python -m tests.support.doctor_states BOARD RANK [options]`` publishes one rank's load every 10 ms
until SIGTERM (at most ``--seconds``): fixed tokens and KV use, a received count that grows at
``--recv-rate`` requests per second, and with ``--pd MODE`` a disaggregation detail whose decode
transfer queue grows by ``--transfer-growth`` requests per second. ``--once`` publishes one snapshot
and exits (its slot goes stale, its pid gone). Prints "ready PID" after the first publish.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from dpboard import Board, LoadSnapshot
from dpboard.snapshot import DisaggregationDetail, LoadDetail
from tests.support.names import ROOT
from tests.support.procutil import read_line


def start_writer(board: str, rank: int, *args: str) -> subprocess.Popen:
    """A writer process for ``rank`` of ``board`` that has published once."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.doctor_states", board, str(rank), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = read_line(proc, 30)
    assert line.startswith("ready"), line
    return proc


def main(argv: Sequence[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("board")
    p.add_argument("rank", type=int)
    p.add_argument("--total", type=int, default=1000)
    p.add_argument("--used", type=int, default=1000)
    p.add_argument("--cap", type=int, default=10_000)
    p.add_argument("--running", type=int, default=2)
    p.add_argument("--waiting", type=int, default=0)
    p.add_argument("--recv-rate", type=float, default=0.0)
    p.add_argument("--pd", choices=("prefill", "decode"))
    p.add_argument("--transfer-growth", type=float, default=0.0)
    p.add_argument("--once", action="store_true")
    p.add_argument("--seconds", type=float, default=120.0)
    a = p.parse_args(argv)
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    board = Board.attach(a.board)
    writer = board.writer(a.rank)
    start = time.monotonic()

    def publish() -> None:
        elapsed = time.monotonic() - start
        snap = LoadSnapshot(dp_rank=a.rank, num_running_reqs=a.running, num_waiting_reqs=a.waiting,
                            num_used_tokens=a.used, num_total_tokens=a.total, num_active_tokens=a.total,
                            max_total_num_tokens=a.cap, num_received_reqs=int(a.recv_rate * elapsed))
        detail = None
        if a.pd is not None:
            transfer = 1 + int(a.transfer_growth * elapsed) if a.pd == "decode" else 0
            detail = LoadDetail(disaggregation=DisaggregationDetail(a.pd, decode_transfer_queue_reqs=transfer))
        writer.publish_detailed(snap, detail)

    publish()
    print("ready", os.getpid(), flush=True)
    if a.once:
        return 0
    deadline = start + a.seconds  # never outlive a test that forgot us
    while not stop and time.monotonic() < deadline:
        time.sleep(0.01)
        publish()
    board.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
