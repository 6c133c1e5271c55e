"""A scheduler loop that publishes its rank's load with dpboard.LoadPublisher.

The "scheduler" here is a toy: a request table and a KV page table in NumPy, changed a little every
step. A real scheduler keeps the same three arrays (on the GPU or the host) and makes the same two
calls: one LoadPublisher at start-up, one ``step()`` per scheduler iteration.

    python examples/embed_writer.py --board demo --rank 0 --steps 1000
    dpboard dump demo          # in another terminal
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from dpboard import Board, LoadPublisher, PageState, ReqState


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--board", default="embed-example")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--n-slots", type=int, default=1, help="slots when the board has to be created")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=0.001, help="seconds between scheduler steps")
    parser.add_argument("--max-requests", type=int, default=4096)
    parser.add_argument("--num-pages", type=int, default=65536)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--backend", default="auto")
    args = parser.parse_args(argv)

    board = Board.create(args.board, n_slots=max(args.n_slots, args.rank + 1), exist_ok=True)
    rng = np.random.default_rng(args.rank)

    # The scheduler's tables: allocated once, updated in place.
    req_state = np.zeros(args.max_requests, dtype=np.int8)  # ReqState codes
    req_seqlen = np.zeros(args.max_requests, dtype=np.int32)
    page_state = np.zeros(args.num_pages, dtype=np.int8)  # PageState codes

    publisher = LoadPublisher(board, args.rank, (req_state, req_seqlen, page_state),
                              page_size=args.page_size, backend=args.backend)
    received = 0
    loads = None
    try:
        for _ in range(args.steps):
            # -- the scheduler's own work (here: random arrivals, admissions and completions) --
            free_rows = np.flatnonzero(req_state == ReqState.FREE)[: rng.integers(0, 4)]
            req_state[free_rows] = ReqState.WAITING
            req_seqlen[free_rows] = rng.integers(64, 4096, free_rows.size)
            received += free_rows.size
            waiting = np.flatnonzero(req_state == ReqState.WAITING)[:2]
            req_state[waiting] = ReqState.RUNNING
            page_state[rng.integers(0, args.num_pages, 32)] = PageState.USED
            done = np.flatnonzero(req_state == ReqState.RUNNING)[: rng.integers(0, 3)]
            req_state[done] = ReqState.FREE
            page_state[rng.integers(0, args.num_pages, 24)] = PageState.EVICTABLE

            # -- one call per step: compute the loads from the tables and publish them --
            loads = publisher.step(num_received_reqs=received)
            time.sleep(args.interval)
    finally:
        publisher.close()
        board.close()
        if board.is_owner:
            board.unlink()
    print(f"published {publisher.steps} snapshots from rank {args.rank} ({publisher.backend}); last: {loads}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
