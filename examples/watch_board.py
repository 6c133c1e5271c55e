"""Follow a board from a script: one line per sample, through its vanishing and coming back.

    python examples/watch_board.py NAME [--seconds 10]

``BoardWatch`` is what ``dpboard top`` and ``dpboard serve`` read boards with; each ``sample()``
gives a ``Frame`` (rows, liveness counts, imbalance, totals, rates).
"""

from __future__ import annotations

import argparse
import sys
import time

from dpboard.errors import DpboardError
from dpboard.options import seconds
from dpboard.views.watch import BoardWatch


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("name", help="board name (`dpboard ls` lists them); waited for if it does not exist yet")
    parser.add_argument("--seconds", type=seconds(), default=10.0, help="how long to watch")
    parser.add_argument("--every", type=seconds(), default=0.5, help="seconds between samples")
    args = parser.parse_args(argv)
    try:
        watch = BoardWatch(args.name, stale_after=1.0, wait=True)
    except DpboardError as e:
        parser.error(str(e))
    deadline = time.monotonic() + args.seconds
    try:
        while time.monotonic() < deadline:
            frame = watch.sample()
            if frame.gone:
                print(frame.gone)
            else:
                imbalance = f"{frame.imbalance:.2f}" if frame.imbalance is not None else "-"
                rate = f"{frame.publish_rate:.0f}/s" if frame.publish_rate is not None else "-"
                print(f"{frame.board}: {frame.counts['live']} live, {frame.counts['stale']} stale, "
                      f"imbalance {imbalance}, total tokens {frame.totals['num_total_tokens']}, publishes {rate}")
            time.sleep(args.every)
    except KeyboardInterrupt:
        pass
    finally:
        watch.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
