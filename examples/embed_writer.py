"""A scheduler loop that publishes its rank's load with dpboard.LoadPublisher.

The "scheduler" here is a toy: a request table and a KV page table in NumPy, changed a little every
step. A real scheduler keeps the same three arrays (on the GPU or the host) and makes the same two
calls: one LoadPublisher at start-up, one ``step()`` per scheduler iteration.

    python examples/embed_writer.py --board demo --steps 5000 --interval 0.002
    dpboard top demo --wait    # in another terminal, started before or during the run

The board it creates lives as long as this process: it is removed when the run ends.
``--linger SECONDS`` keeps it that much longer after the last step (its slot turns stale), so that
``dpboard dump demo`` in another terminal still shows the last snapshot.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np

from dpboard import Board, LoadPublisher, PageState, ReqState
from dpboard.errors import DpboardError
from dpboard.options import count, seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--board", default="embed-example", help="board name (created if it does not exist)")
    parser.add_argument("--rank", type=count(0, 65535), default=0, help="this scheduler's DP rank")
    parser.add_argument("--n-slots", type=count(1, 65536), default=1, help="slots when the board has to be created")
    parser.add_argument("--steps", type=count(1), default=1000, help="scheduler steps to run")
    parser.add_argument("--interval", type=seconds(60, zero=True), default=0.001, help="seconds between scheduler steps")
    parser.add_argument("--max-requests", type=count(1), default=4096, help="rows of the request table")
    parser.add_argument("--num-pages", type=count(1), default=65536, help="KV pages")
    parser.add_argument("--page-size", type=count(1, 1 << 16), default=16, help="tokens per KV page")
    parser.add_argument("--backend", default="auto", choices=("auto", "numpy", "numba", "numba-cuda", "cupy"),
                        help="kernel that computes the loads")
    parser.add_argument("--linger", type=seconds(3600, zero=True), default=0.0,
                        help="seconds the board stays after the last step, for `dpboard dump`")
    args = parser.parse_args(argv)

    board = Board.create(args.board, n_slots=max(args.n_slots, args.rank + 1), exist_ok=True)
    rng = np.random.default_rng(args.rank)

    # The scheduler's tables: allocated once, updated in place.
    req_state = np.zeros(args.max_requests, dtype=np.int8)  # ReqState codes
    req_seqlen = np.zeros(args.max_requests, dtype=np.int32)
    page_state = np.zeros(args.num_pages, dtype=np.int8)  # PageState codes

    try:
        publisher = LoadPublisher(board, args.rank, (req_state, req_seqlen, page_state),
                                  page_size=args.page_size, backend=args.backend)
    except BaseException:  # e.g. --backend cupy on a machine without CuPy: leave no board behind
        board.close()
        if board.is_owner:
            board.unlink()
        raise
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
            if args.linger:
                print(f"board {args.board!r} stays {args.linger:g} s more: `dpboard dump {args.board}` shows it",
                      flush=True)
                time.sleep(args.linger)
            board.unlink()
    print(f"published {publisher.steps} snapshots from rank {args.rank} ({publisher.backend}); last: {loads}")
    return 0


if __name__ == "__main__":
    try:
        raise SystemExit(main())
    except DpboardError as e:  # a user's mistake or a missing package: one line, as dpboard's commands
        print(f"embed_writer.py: {e}", file=sys.stderr)
        raise SystemExit(2) from None
