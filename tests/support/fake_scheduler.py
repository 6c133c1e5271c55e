"""A stand-in scheduler process for the controller tests: binds a PULL, records what arrives,
publishes its load into the board, and on SIGTERM writes the rids it got to a JSON file.

``python -m tests.support.fake_scheduler BOARD RANK ENDPOINT OUT_PATH [--log PATH] [--no-count]`` (from the
repository root). With ``--log`` every rid is appended to PATH as it arrives, before the count that
acknowledges it is published, so that a scheduler killed with SIGKILL still leaves its record: what
it received, in order, of which the board's ``num_received_reqs`` counts a prefix.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

import msgpack
import zmq

from dpboard import Board


def fake_scheduler(board_name: str, rank: int, endpoint: str, out_path: str, log_path: str | None = None,
                   count: bool = True) -> int:
    """Bind a PULL, count what arrives, publish the load to the board; on SIGTERM write the rids.
    ``count=False``: publish num_received_reqs 0 whatever arrives (as a vLLM board does)."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    board = Board.attach(board_name)
    writer = board.writer(rank)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600) if log_path else None
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    rids: list = []
    tokens = 0
    writer.publish_values(0, 0, 0, 0, 0, 10**6, 0)
    print("ready", flush=True)
    deadline = time.monotonic() + 60  # never outlive a test that forgot us
    while not stop and time.monotonic() < deadline:
        if sock.poll(20):
            batch = []
            while True:
                try:
                    raw = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = msgpack.unpackb(raw, raw=False)
                batch.append(msg["rid"])
                tokens += len(msg["input_ids"]) if msg.get("input_ids") is not None else msg["num_tokens"]
            if log_fd is not None and batch:
                os.write(log_fd, "".join(f"{rid}\n" for rid in batch).encode())  # recorded before counted
            rids.extend(batch)
        writer.publish_values(0, len(rids), tokens, tokens, tokens, 10**6, len(rids) if count else 0)
    Path(out_path).write_text(json.dumps({"rank": rank, "rids": rids}))
    sock.close()
    ctx.term()
    board.close()
    return 0


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("board")
    p.add_argument("rank", type=int)
    p.add_argument("endpoint")
    p.add_argument("out")
    p.add_argument("--log", default=None)
    p.add_argument("--no-count", action="store_true")
    a = p.parse_args()
    sys.exit(fake_scheduler(a.board, a.rank, a.endpoint, a.out, a.log, count=not a.no_count))
