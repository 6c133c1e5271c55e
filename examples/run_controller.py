"""A controller in front of two fake schedulers, on one machine, for a few seconds.

    python examples/run_controller.py

Each scheduler binds a PULL, counts what it receives and publishes its load to a board; the
controller picks ranks with inflight_tokens; a client sends requests of mixed lengths.
"""

from __future__ import annotations

import os
import random
import tempfile
import threading
import time

import msgpack
import zmq

from dpboard import Board
from dpboard.controller import DataParallelController, Dispatcher
from dpboard.controller.codec import encode_request


def scheduler(board: Board, rank: int, endpoint: str, stop: threading.Event, ctx: zmq.Context) -> None:
    writer = board.writer(rank)
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    received, tokens = 0, 0
    while not stop.is_set():
        if sock.poll(10):
            msg = msgpack.unpackb(sock.recv(), raw=False)
            received += 1
            tokens += len(msg["input_ids"])
        tokens = max(0, tokens - 200)  # the rank works its queue down
        writer.publish_values(0, 0, tokens, tokens, tokens, 100_000, received)
    print(f"rank {rank}: received {received} requests")
    sock.close()


def main() -> None:
    tmp = tempfile.mkdtemp()
    endpoints = [f"ipc://{tmp}/sched-{r}" for r in range(2)]
    ctx = zmq.Context()
    stop = threading.Event()
    with Board.create(f"example-{os.getpid()}", n_slots=2) as board:
        threads = [threading.Thread(target=scheduler, args=(board, r, ep, stop, ctx)) for r, ep in enumerate(endpoints)]
        for t in threads:
            t.start()
        dispatcher = Dispatcher("inflight_tokens", 2, reader=board.reader())
        controller = DataParallelController(dispatcher, endpoints, f"ipc://{tmp}/in", context=ctx)
        runner = threading.Thread(target=controller.run, kwargs={"duration": 2.0})
        runner.start()
        client = ctx.socket(zmq.PUSH)
        client.connect(f"ipc://{tmp}/in")
        for i in range(500):
            client.send(encode_request(f"r{i}", input_ids=[0] * random.choice([30, 30, 30, 3000])))
            time.sleep(0.002)
        runner.join()
        stop.set()
        for t in threads:
            t.join()
        print("controller:", controller.stats)
        client.close()
        controller.close()
    ctx.term()


if __name__ == "__main__":
    main()
