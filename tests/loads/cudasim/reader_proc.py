"""A reader process for the GPU-direct test: hammers one slot and checks every snapshot it accepts.

``python reader_proc.py BOARD RANK PAGE_SIZE NUM_PAGES LAST_K SECONDS``: prints "ready" once attached,
then reads until it has seen publish LAST_K (or SECONDS passed, or SIGTERM came), then prints one
JSON line of counts.
The publishing test makes publish k carry k RUNNING and k WAITING requests of 1000 tokens and k
USED pages, so every field of a whole snapshot follows from num_running_reqs.
"""

from __future__ import annotations

import json
import signal
import sys
import time

from dpboard import Board


def main() -> None:
    name, rank, page_size, num_pages, last_k = sys.argv[1], *map(int, sys.argv[2:6])
    seconds = float(sys.argv[6])
    board = Board.attach(name)
    reader = board.reader(max_retries=64)
    counts = {"reads": 0, "whole": 0, "empty_or_torn": 0, "inconsistent": 0, "seq_backwards": 0, "max_k": 0}
    last_seq = 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))  # report the counts when told to stop
    print("ready", flush=True)  # attached and able to report: the publishing test may start
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not stop:
        counts["reads"] += 1
        snap = reader.read(rank)
        if snap is None:
            counts["empty_or_torn"] += 1
            continue
        k = snap.num_running_reqs
        used = k * page_size
        expected = (k, used, used + 1000 * k, used + 1000 * k, num_pages * page_size, k)
        got = (snap.num_waiting_reqs, snap.num_used_tokens, snap.num_total_tokens, snap.num_active_tokens,
               snap.max_total_num_tokens, snap.num_received_reqs)
        if k and (got != expected or snap.dp_rank != rank or snap.num_total_tokens < snap.num_used_tokens):
            counts["inconsistent"] += 1
        if snap.publish_seq < last_seq:
            counts["seq_backwards"] += 1
        last_seq = snap.publish_seq
        counts["whole"] += 1
        counts["max_k"] = max(counts["max_k"], k)
        if k >= last_k:
            break
    print(json.dumps(counts), flush=True)


if __name__ == "__main__":
    main()
