"""A scheduler that a request kills: ``python -m tests.controller.dying_scheduler BOARD RANK ENDPOINT``.

It binds a PULL, counts what arrives in its board slot's ``num_received_reqs`` (published every
20 ms) and prints each rid as it takes it. A request whose rid starts with ``poison`` kills it with
SIGKILL before it is counted, as a request an engine cannot survive would: the controller sees the
connection break with that request unacknowledged."""

from __future__ import annotations

import os
import signal
import sys
import time

import msgpack
import zmq

from dpboard import Board


def main(board_name: str, rank: int, endpoint: str) -> int:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    board = Board.attach(board_name)
    writer = board.writer(rank)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    received = 0
    writer.publish_values(0, 0, 0, 0, 0, 10**6, 0)
    deadline = time.monotonic() + 90  # never outlive a test that forgot us
    while not stop and time.monotonic() < deadline:
        if sock.poll(20):
            while True:
                try:
                    rid = msgpack.unpackb(sock.recv(zmq.NOBLOCK))["rid"]
                except zmq.Again:
                    break
                print(rid, flush=True)
                if str(rid).startswith("poison"):
                    os.kill(os.getpid(), signal.SIGKILL)
                received += 1
        writer.publish_values(0, 0, 0, 0, 0, 10**6, received)
    sock.close()
    ctx.term()
    board.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
