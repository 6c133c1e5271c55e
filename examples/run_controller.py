"""A controller in front of two fake schedulers, on one machine, until every request is delivered.

    python examples/run_controller.py [--requests 500] [--method inflight_tokens]

Each scheduler binds a PULL, counts what it receives and publishes its load to a board, the count
included; the controller picks ranks with the method and reads those counts back as delivery
acknowledgements (``acks=``: docs/DISPATCH.md, "Delivery"), so its ``delivered`` counts what
reached a scheduler. A client sends requests of mixed lengths.
"""

from __future__ import annotations

import argparse
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
from dpboard.methods import METHOD_CHOICES, LoadBalanceMethod, resolve_load_balance_method
from dpboard.options import count, seconds


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
        # running, waiting, used, total, active, capacity, received (the count the controller reads)
        writer.publish_values(0, 0, tokens, tokens, tokens, 100_000, received)
    print(f"rank {rank}: received {received} requests")
    sock.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--requests", type=count(1, 1_000_000), default=500, help="requests the client sends")
    parser.add_argument("--method", default="inflight_tokens", choices=METHOD_CHOICES, help="the controller's method")
    parser.add_argument("--duration", type=seconds(3600), default=60.0,
                        help="seconds the controller runs at most: it stops once every request sent has reached "
                             "a scheduler (the client sends one request every 2 ms)")
    args = parser.parse_args(argv)

    tmp = tempfile.mkdtemp()
    endpoints = [f"ipc://{tmp}/sched-{r}" for r in range(2)]
    ctx = zmq.Context()
    stop = threading.Event()
    with Board.create(f"example-{os.getpid()}", n_slots=2) as board:
        threads = [threading.Thread(target=scheduler, args=(board, r, ep, stop, ctx)) for r, ep in enumerate(endpoints)]
        for t in threads:
            t.start()
        dispatcher = Dispatcher(args.method, 2, reader=board.reader())
        controller = DataParallelController(dispatcher, endpoints, f"ipc://{tmp}/in", context=ctx,
                                            acks=board.reader())
        runner = threading.Thread(target=controller.run, kwargs={"duration": args.duration})
        runner.start()
        client = ctx.socket(zmq.PUSH)
        client.connect(f"ipc://{tmp}/in")
        # follow_bootstrap_room maps each request's room to a rank: give rooms, as a PD router would
        rooms = resolve_load_balance_method(args.method) is LoadBalanceMethod.FOLLOW_BOOTSTRAP_ROOM
        for i in range(args.requests):
            room = random.getrandbits(63) if rooms else None
            client.send(encode_request(f"r{i}", input_ids=[0] * random.choice([30, 30, 30, 3000]),
                                       bootstrap_room=room))
            time.sleep(0.002)
        # every request acknowledged by a scheduler's count (or the duration up), then the controller stops
        while runner.is_alive() and controller.stats["delivered"] + controller.stats["rejected"] < args.requests:
            runner.join(0.05)
        controller.stop()
        runner.join()
        stop.set()
        for t in threads:
            t.join()
        print("controller:", controller.stats)
        client.close()
        controller.close()
    ctx.term()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
