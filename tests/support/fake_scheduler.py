"""A stand-in scheduler process for the controller tests: binds a PULL, records what arrives,
publishes its load into the board, and on SIGTERM writes the rids it got to a JSON file.

``python -m tests.support.fake_scheduler BOARD RANK ENDPOINT OUT_PATH`` (from the repository root).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

import msgpack
import zmq

from dpboard import Board


def fake_scheduler(board_name: str, rank: int, endpoint: str, out_path: str) -> int:
    """Bind a PULL, count what arrives, publish the load to the board; on SIGTERM write the rids."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    board = Board.attach(board_name)
    writer = board.writer(rank)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    rids: list = []
    tokens = 0
    writer.publish_values(0, 0, 0, 0, 0, 10**6, 0)
    deadline = time.monotonic() + 60  # never outlive a test that forgot us
    while not stop and time.monotonic() < deadline:
        if sock.poll(20):
            while True:
                try:
                    raw = sock.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                msg = msgpack.unpackb(raw, raw=False)
                rids.append(msg["rid"])
                tokens += len(msg["input_ids"]) if msg.get("input_ids") is not None else msg["num_tokens"]
        writer.publish_values(0, len(rids), tokens, tokens, tokens, 10**6, len(rids))
    Path(out_path).write_text(json.dumps({"rank": rank, "rids": rids}))
    sock.close()
    ctx.term()
    board.close()
    return 0


if __name__ == "__main__":
    sys.exit(fake_scheduler(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]))
